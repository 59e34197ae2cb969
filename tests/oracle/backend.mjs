// The oracle's Node backends (tests/it/boundary_oracle.rs), the same contract as backends.py:
// `/v1/payments` and `/v2/orders/:id` run one handler that counts and answers 201 with what it
// read; `GET /__count` answers the executions. Each framework with its defaults, plus a form
// parser: Express's own `express.urlencoded()` (its defaults); Fastify has none (415 for a form), so
// it is given node:querystring as its parser, the way @fastify/formbody registers one. For
// multipart/form-data: multer's `any()` for Express (busboy), @fastify/multipart for Fastify
// (@fastify/busboy), each with its defaults (files in memory). A body that is not JSON is
// reported as `{form: {name: [values in the order sent]}, files: {name: [[filename, sha256 of the
// content]]}}` (what was parsed). A JSON-RPC request
// body (an object with a `method`) is answered with what was read as the `result` of a JSON-RPC
// response with the request's `id`.
//
// usage: node backend.mjs express|fastify PORT NODE_DIR
// The packages come from NODE_DIR (target/oracle-node, `scripts/install-deps.sh oracle-panel`).
import { createRequire } from "node:module";
import querystring from "node:querystring";
import { createHash } from "node:crypto";
const [kind, portText, nodeDir] = process.argv.slice(2);
const require = createRequire(`${nodeDir}/package.json`);
const port = Number(portText);
let count = 0;

const sha = (buf) => createHash("sha256").update(buf).digest("hex");

// A parsed form (an object whose repeated fields are arrays) as name -> [values], or {} for none,
// and its files ([{fieldname, originalname, buffer}] in the order sent) as name -> [[filename, sha]].
function form(parsed, fileList) {
  const out = {};
  if (parsed && typeof parsed === "object") {
    for (const [k, v] of Object.entries(parsed)) out[k] = [].concat(v).map(String);
  }
  const files = {};
  for (const f of fileList || []) (files[f.fieldname] ||= []).push([f.originalname, sha(f.buffer)]);
  return { form: out, files };
}

function report(route, params, method, path, host, headers, query, body) {
  const all = (n) => {
    const v = headers[n];
    return v === undefined ? [] : Array.isArray(v) ? v : [v];
  };
  const q = [];
  for (const [k, v] of Object.entries(query || {})) for (const one of [].concat(v)) q.push([k, String(one)]);
  q.sort();
  const r = {
    route, params, method, path, host,
    authorization: all("authorization"), "x-caller": all("x-caller"),
    "idempotency-key": all("idempotency-key"), "x-op": all("x-op"),
    query: q, body: body === undefined ? null : body,
  };
  if (body && typeof body === "object" && !Array.isArray(body) && "method" in body) {
    return { jsonrpc: "2.0", id: body.id === undefined ? null : body.id, result: r };
  }
  return r;
}

if (kind === "express") {
  const express = require("express");
  const app = express();
  app.use(express.json());
  app.use(express.urlencoded());
  app.use(require("multer")().any());
  const read = (route) => (req, res) => {
    count++;
    const params = route === "orders" ? { id: req.params.id } : {};
    const body = req.is("json") ? req.body : form(req.body, req.files);
    res.status(201).json(report(route, params, req.method, req.path, req.get("host"), req.headers, req.query, body));
  };
  app.all("/v1/payments", read("payments"));
  app.all("/v2/orders/:id", read("orders"));
  app.get("/__count", (req, res) => res.json({ count }));
  app.listen(port, "127.0.0.1", () => console.log(`PORT ${port}`));
} else if (kind === "fastify") {
  const Fastify = require("fastify");
  const app = Fastify();
  app.addContentTypeParser("application/x-www-form-urlencoded", { parseAs: "string" }, (req, text, done) =>
    done(null, querystring.parse(text)),
  );
  await app.register(require("@fastify/multipart"));
  const methods = ["GET", "POST", "PUT", "PATCH", "DELETE"];
  const read = (route) => async (req, reply) => {
    // A multipart body is read (parts, in the order sent) before the execution counts: a body
    // the parser refuses is the framework's error, not an execution.
    let parsed = req.body;
    const fileList = [];
    if (req.isMultipart()) {
      parsed = {};
      for await (const part of req.parts()) {
        if (part.type === "file") {
          fileList.push({ fieldname: part.fieldname, originalname: part.filename, buffer: await part.toBuffer() });
        } else {
          (parsed[part.fieldname] ||= []).push(part.value);
        }
      }
    }
    count++;
    const params = route === "orders" ? { id: req.params.id } : {};
    const path = req.url.split("?")[0];
    // Fastify's own content-type parsers decide (415 for a type it has none for).
    const json = String(req.headers["content-type"] || "").toLowerCase().includes("json");
    const body = json ? req.body : form(parsed, fileList);
    reply.code(201).send(report(route, params, req.method, path, req.headers.host, req.headers, req.query, body));
  };
  app.route({ method: methods, url: "/v1/payments", handler: read("payments") });
  app.route({ method: methods, url: "/v2/orders/:id", handler: read("orders") });
  app.get("/__count", async () => ({ count }));
  await app.listen({ port, host: "127.0.0.1" });
  console.log(`PORT ${port}`);
} else {
  console.error(`unknown backend ${kind}`);
  process.exit(2);
}
