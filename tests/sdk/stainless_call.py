"""One logical call with a pinned Stainless-generated SDK (tests/sdk/requirements.txt): openai,
anthropic, modern-treasury or orb-billing (`--sdk orb`), for tests/it/sdk_clients.rs. Prints a JSON
report on stdout: what the SDK returned or raised, and how many HTTP requests it sent (retries
included), counted by an httpx request hook on the client the SDK uses.

    stainless_call.py --sdk openai|anthropic|modern-treasury|orb <call_args.py's arguments>

openai and anthropic send no idempotency key themselves: the key goes in as docs/agents.md shows ("SDKs that send no key"), a
per-request header (`extra_headers={"Idempotency-Key": K}`). modern-treasury and orb-billing send
their own `Idempotency-Key` on every POST (one key per call, reused by its retries: _base_client.py);
`--key` gives it a stable one through its `idempotency_key=` argument, and without `--key` the
SDK's own key is used. `--header` adds test knobs (`x-up-*`) as per-request headers.
"""
import importlib
import json
import sys

import call_args

sent = []


def count(request):
    sent.append(request.headers.get("idempotency-key"))


def main():
    a, headers = call_args.parse(
        lambda ap: ap.add_argument("--sdk", required=True, choices=["openai", "anthropic", "modern-treasury", "orb"])
    )
    # The client the SDK itself uses: httpx (modern-treasury, orb) or its fork httpx2 (openai and
    # anthropic, which refuse an httpx.Client).
    http = importlib.import_module("httpx" if a.sdk in ("modern-treasury", "orb") else "httpx2")
    common = dict(max_retries=a.retries, timeout=a.timeout, http_client=http.Client(event_hooks={"request": [count]}))
    if a.sdk == "openai":
        import openai as sdk

        if a.key is not None:
            headers["Idempotency-Key"] = a.key
        client = sdk.OpenAI(api_key="sk-idemgate", base_url=a.base + "/v1", **common)

        def create():
            return client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": f"amount {a.amount}"}],
                extra_headers=headers,
            )

    elif a.sdk == "anthropic":
        import anthropic as sdk

        if a.key is not None:
            headers["Idempotency-Key"] = a.key
        client = sdk.Anthropic(api_key="sk-ant-idemgate", base_url=a.base, **common)

        def create():
            return client.messages.create(
                model="claude-sonnet-4-5",
                max_tokens=a.amount,
                messages=[{"role": "user", "content": "hello"}],
                extra_headers=headers,
            )

    elif a.sdk == "orb":
        import orb as sdk

        client = sdk.Orb(api_key="orb-idemgate", base_url=a.base + "/v1", **common)
        extra = {} if a.key is None else {"idempotency_key": a.key}

        def create():
            return client.customers.create(
                email="c@example.com", name=f"customer {a.amount}", extra_headers=headers, **extra
            )

    else:
        import modern_treasury as sdk

        client = sdk.ModernTreasury(api_key="mt-idemgate", organization_id="org-idemgate", base_url=a.base, **common)
        extra = {} if a.key is None else {"idempotency_key": a.key}

        def create():
            return client.counterparties.create(name=f"counterparty {a.amount}", extra_headers=headers, **extra)

    report = {"sdk": f"{a.sdk} {sdk.__version__}"}
    try:
        obj = create()
        report.update(outcome="returned", id=getattr(obj, "id", None), body=obj.to_dict())
    except sdk.APIStatusError as e:
        body = e.body
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
            # orb replaces a body it cannot classify by status (5xx) with its own generic one
            # (`type: .../500-internal-server-error`); the problem it received is in e.response.
            try:
                body = e.response.json()
            except ValueError:
                pass
        err = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else body
        report.update(outcome="raised", error_class=type(e).__name__, http_status=e.status_code, message=str(e), error=err)
    except Exception as e:  # anything else the SDK raises is still an error, named as such
        report.update(outcome="raised", error_class=type(e).__name__, message=str(e), error=None)
    report["requests_sent"] = len(sent)
    report["keys_sent"] = sorted(set(k or "" for k in sent))
    json.dump(report, sys.stdout)


main()
