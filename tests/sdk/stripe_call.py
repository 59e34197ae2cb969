"""One logical call with the pinned stripe-python SDK (tests/sdk/requirements.txt), for
tests/it/sdk_clients.rs: creates a PaymentIntent through Envoy + idemgate and prints a JSON report
on stdout: what the SDK returned or raised, and how many HTTP requests it sent (retries included).

    stripe_call.py --base http://127.0.0.1:PORT --key K --amount 4200 --retries 2 \
        [--timeout 30] [--header "name: value"]...
"""
import json
import sys

import call_args

import stripe


class CountingClient(stripe.RequestsClient):
    """The SDK's own requests client, counting the requests the SDK sends (retries included)."""

    sent = 0

    def request(self, method, url, headers, post_data=None, **kwargs):
        CountingClient.sent += 1
        return super().request(method, url, headers, post_data, **kwargs)


def main():
    a, headers = call_args.parse()
    client = stripe.StripeClient(
        "sk_test_idemgate",
        base_addresses={"api": a.base},
        max_network_retries=a.retries,
        http_client=CountingClient(timeout=a.timeout),
    )
    options = {"headers": headers}
    if a.key is not None:
        options["idempotency_key"] = a.key
    report = {"sdk": "stripe-python " + stripe.VERSION}
    try:
        pi = client.v1.payment_intents.create(params={"amount": a.amount, "currency": "eur"}, options=options)
        body = pi.to_dict()
        report.update(outcome="returned", id=body.get("id"), body=body)
    except stripe.StripeError as e:
        err = (e.json_body or {}).get("error") if isinstance(e.json_body, dict) else None
        report.update(
            outcome="raised",
            error_class=type(e).__name__,
            http_status=e.http_status,
            message=e.user_message,
            code=e.code,
            error=err,
            problem_type=(e.json_body or {}).get("type") if isinstance(e.json_body, dict) else None,
        )
    except Exception as e:  # anything else the SDK raises is still an error, named as such
        report.update(outcome="raised", error_class=type(e).__name__, message=str(e))
    report["requests_sent"] = CountingClient.sent
    json.dump(report, sys.stdout)


main()
