// One logical call with the pinned stripe-node SDK (tests/sdk/package-lock.json), for
// tests/it/sdk_clients.rs: creates a PaymentIntent through Envoy + idemgate and prints a JSON report
// on stdout: what the SDK returned or threw, and how many HTTP requests it sent (retries included).
//
//   SDK_NODE_DIR=target/sdk-node node stripe_call.js <call_args.js's arguments>
'use strict';
const path = require('path');
const Stripe = require(path.resolve(process.env.SDK_NODE_DIR || 'target/sdk-node', 'node_modules/stripe'));
const args = require('./call_args');

async function main() {
  const a = args();
  const base = new URL(a.base);
  const stripe = new Stripe('sk_test_idemgate', {
    host: base.hostname,
    port: Number(base.port),
    protocol: 'http',
    maxNetworkRetries: Number(a.retries),
    timeout: Number(a.timeout) * 1000,
  });
  let sent = 0;
  stripe.on('request', () => { sent += 1; });
  const options = { headers: a.headers };
  if (a.key !== undefined) options.idempotencyKey = a.key;
  const report = { sdk: 'stripe-node ' + Stripe.PACKAGE_VERSION };
  try {
    const pi = await stripe.paymentIntents.create({ amount: Number(a.amount), currency: 'eur' }, options);
    report.outcome = 'returned';
    report.id = pi.id === undefined ? null : pi.id;
    report.body = pi;
  } catch (e) {
    report.outcome = 'raised';
    report.error_class = e.constructor && e.constructor.name;
    report.type = e.type;
    report.http_status = e.statusCode === undefined ? null : e.statusCode;
    report.message = e.message;
    report.code = e.code === undefined ? null : e.code;
    report.error = e.raw ? { type: e.raw.type, code: e.raw.code, message: e.raw.message } : null;
  }
  report.requests_sent = sent;
  // Exit once written: a keep-alive socket to Envoy would otherwise hold the process open.
  process.stdout.write(JSON.stringify(report), () => process.exit(0));
}

main();
