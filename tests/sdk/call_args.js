// The command line every tests/sdk/*_call.js script takes, as tests/sdk/call_args.py describes it
// (`--base`, `--key`, `--amount`, `--retries`, `--timeout` in seconds, `--header "name: value"`
// repeated, and a script's own `--sdk`). Returns the arguments, the headers as an object.
'use strict';

module.exports = function args() {
  const a = { amount: 4200, retries: 2, timeout: 30, headers: {} };
  const v = process.argv.slice(2);
  for (let i = 0; i < v.length; i += 2) {
    const [name, value] = [v[i], v[i + 1]];
    if (name === '--header') {
      const at = value.indexOf(': ');
      a.headers[value.slice(0, at)] = value.slice(at + 2);
    } else {
      a[name.slice(2)] = value;
    }
  }
  return a;
};
