// One logical call with a pinned Stainless-generated Node SDK (tests/sdk/package-lock.json):
// openai-node or modern-treasury-node, for tests/it/sdk_clients.rs. Prints a JSON report on stdout:
// what the SDK returned or threw, and how many HTTP requests it sent (retries included), counted
// by the `fetch` the SDK is given.
//
//   SDK_NODE_DIR=target/sdk-node node stainless_call.js --sdk openai|modern-treasury <call_args.js's arguments>
//
// openai-node sends no idempotency key itself (its idempotencyHeader is unset): the key goes in
// as a per-request header (`{ headers: { 'Idempotency-Key': K } }`). modern-treasury-node sends
// its own `Idempotency-Key` on every POST, reused by its retries; `--key` gives it a stable one
// through the `idempotencyKey` request option, and without `--key` the SDK's own key is used.
'use strict';
const path = require('path');
const args = require('./call_args');

const sent = [];
function countingFetch(url, init) {
  const h = new Headers(init && init.headers);
  sent.push(h.get('idempotency-key'));
  return fetch(url, init);
}

async function main() {
  const a = args();
  const dir = path.resolve(process.env.SDK_NODE_DIR || 'target/sdk-node', 'node_modules');
  const common = { maxRetries: Number(a.retries), timeout: Number(a.timeout) * 1000, fetch: countingFetch };
  const headers = { ...a.headers };
  let SDK, create;
  if (a.sdk === 'openai') {
    SDK = require(path.join(dir, 'openai'));
    const client = new SDK.OpenAI({ apiKey: 'sk-idemgate', baseURL: a.base + '/v1', ...common });
    if (a.key !== undefined) headers['Idempotency-Key'] = a.key;
    create = () =>
      client.chat.completions.create(
        { model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'amount ' + a.amount }] },
        { headers },
      );
  } else if (a.sdk === 'modern-treasury') {
    SDK = require(path.join(dir, 'modern-treasury'));
    const client = new SDK.ModernTreasury({
      apiKey: 'mt-idemgate',
      organizationID: 'org-idemgate',
      baseURL: a.base,
      ...common,
    });
    const options = { headers };
    if (a.key !== undefined) options.idempotencyKey = a.key;
    create = () => client.counterparties.create({ name: 'counterparty ' + a.amount }, options);
  } else {
    throw new Error('--sdk openai|modern-treasury');
  }
  const version = require(path.join(dir, a.sdk, 'version')).VERSION;
  const report = { sdk: a.sdk + '-node ' + version };
  try {
    const obj = await create();
    report.outcome = 'returned';
    report.id = obj && obj.id !== undefined ? obj.id : null;
    report.body = obj;
  } catch (e) {
    report.outcome = 'raised';
    report.error_class = e.constructor && e.constructor.name;
    report.http_status = e.status === undefined ? null : e.status;
    report.message = e.message;
    const body = e.error;
    report.error = body && typeof body === 'object' && body.error && typeof body.error === 'object' ? body.error : body === undefined ? null : body;
  }
  report.requests_sent = sent.length;
  report.keys_sent = [...new Set(sent.map((k) => k || ''))].sort();
  // Exit once written: a keep-alive socket to Envoy would otherwise hold the process open.
  process.stdout.write(JSON.stringify(report), () => process.exit(0));
}

main();
