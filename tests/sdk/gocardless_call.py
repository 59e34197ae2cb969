"""One logical call with the pinned gocardless-pro SDK (tests/sdk/requirements.txt), for
tests/it/sdk_clients.rs: creates a payment through Envoy + idemgate and prints a JSON report on
stdout: what the SDK returned or raised, and how many HTTP requests it sent (its own retries on
timeouts, connection errors and malformed responses included). Same arguments as stripe_call.py;
gocardless-pro retries 3 times in all, whatever --retries says.
"""
import json
import sys

import call_args

import gocardless_pro
from gocardless_pro import api_client, errors

sent = []


def counting(post):
    """requests.post as gocardless-pro calls it, counting requests (those that time out too) and
    keeping the last status (None for a request that got no answer)."""

    def wrapped(*args, **kwargs):
        sent.append(None)
        response = post(*args, **kwargs)
        sent[-1] = response.status_code
        return response

    return wrapped


api_client.requests.post = counting(api_client.requests.post)


def main():
    a, headers = call_args.parse()
    if a.key is not None:
        headers["Idempotency-Key"] = a.key
    client = gocardless_pro.Client(access_token="gc_test_idemgate", base_url=a.base, timeout=a.timeout)
    report = {"sdk": "gocardless-pro 3.22.0"}
    try:
        payment = client.payments.create(params={"amount": a.amount, "currency": "EUR"}, headers=headers)
        report.update(outcome="returned", id=payment.id, body=payment.attributes)
    except errors.ApiError as e:
        report.update(outcome="raised", error_class=type(e).__name__, message=str(e), error=e.error)
    except Exception as e:  # anything else the SDK raises is still an error, named as such
        report.update(outcome="raised", error_class=type(e).__name__, message=str(e), error=None)
    report["http_status"] = sent[-1] if sent else None
    report["requests_sent"] = len(sent)
    json.dump(report, sys.stdout)


main()
