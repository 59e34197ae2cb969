// One MCP caller for tests/it/mcp_sdk.rs: the official TypeScript SDK client
// (@modelcontextprotocol/sdk, pinned in tests/mcp/package-lock.json, installed in target/mcp-node
// by `scripts/install-deps.sh mcp-sdk`) over Streamable HTTP, nothing of ours but the arguments.
//
//   node client.mjs --url http://127.0.0.1:P/mcp --key K --key-via header|meta|arg
//        [--amount 4200] [--currency eur] [--delay-ms 0] [--tool charge] [--fail-code C] --steps same:60,new:60
//
// Same steps and JSON line as tests/mcp/client.py: `same:T` calls in the current client (the
// first step connects one: initialize, and the session the server gives), `new:T` in a new client
// (a new session), T the call's own timeout in seconds.
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL } from "node:url";

const nodeDir = process.env.MCP_NODE_DIR || path.resolve(path.dirname(new URL(import.meta.url).pathname), "../../target/mcp-node");
const require = createRequire(path.join(nodeDir, "package.json"));
const load = async (spec) => import(pathToFileURL(require.resolve(spec)).href);
const { Client } = await load("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = await load("@modelcontextprotocol/sdk/client/streamableHttp.js");

const a = { authorization: "Bearer mcp-test-agent", keyVia: "header", tool: "charge", amount: 4200, currency: "eur", delayMs: 0, steps: "same:60" };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i += 2) {
  const name = argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
  a[name] = argv[i + 1];
}

function toolArguments() {
  if (!a.tool.startsWith("charge")) return { currency: a.currency };
  const args = { amount: Number(a.amount), currency: a.currency };
  if (a.failCode) args.code = Number(a.failCode);
  if (Number(a.delayMs)) args.delay_ms = Number(a.delayMs);
  if (a.key && a.keyVia === "arg") args.idempotency_key = a.key;
  return args;
}

async function connect() {
  // The caller's identity: idemgate scopes keys by it (envoy/mcp/envoy.yaml: scope.headers).
  const headers = { Authorization: a.authorization };
  if (a.key && a.keyVia === "header") headers["Idempotency-Key"] = a.key;
  const transport = new StreamableHTTPClientTransport(new URL(a.url), { requestInit: { headers } });
  const client = new Client({ name: "idemgate-mcp-test", version: "1.0.0" });
  await client.connect(transport);
  return { client, transport };
}

async function oneCall(client, timeoutS) {
  const params = { name: a.tool, arguments: toolArguments() };
  if (a.key && a.keyVia === "meta") params._meta = { idempotencyKey: a.key };
  try {
    const r = await client.callTool(params, undefined, { timeout: timeoutS * 1000 });
    const text = (r.content || []).map((c) => c.text || "").join("");
    return { outcome: "returned", is_error: Boolean(r.isError), text, structured: r.structuredContent ?? null };
  } catch (e) {
    return {
      outcome: "raised",
      error_type: e?.constructor?.name ?? typeof e,
      code: e?.code ?? null,
      message: String(e?.message ?? e),
      data: e?.data ?? null,
    };
  }
}

const steps = [];
let current = null;
for (const spec of a.steps.split(",")) {
  const [kind, t] = spec.split(":");
  const timeoutS = Number(t || 60);
  if (current === null || kind === "new") {
    if (current !== null) {
      await current.client.close().catch((e) => steps.push({ closing_error: String(e) }));
    }
    try {
      current = await connect();
    } catch (e) {
      steps.push({ outcome: "raised", error_type: e?.constructor?.name, code: e?.code ?? null, message: `connect: ${e?.message}`, data: null });
      current = null;
      continue;
    }
  }
  const r = await oneCall(current.client, timeoutS);
  r.session = current.transport.sessionId ?? null;
  steps.push(r);
}
if (current !== null) await current.client.close().catch(() => {});
process.stdout.write(JSON.stringify({ steps }) + "\n");
process.exit(0);
