"""`jaxformer.serving.metrics`: the /metrics page, read back by prometheus_client's own parser."""

import pytest

from jaxformer.serving.metrics import Histogram, ServerMetrics

parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client is in the test extra")


def samples(text: str) -> dict:
    """`{(name, sorted labels): value}` of every sample on a page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def test_a_histogram_counts_each_observation_in_its_bucket_and_every_one_above():
    h = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    assert h.lines("t") == ['t_bucket{le="0.1"} 2', 't_bucket{le="1.0"} 3', 't_bucket{le="+Inf"} 4',
                            "t_sum 3.65", "t_count 4"]


def test_the_page_holds_requests_tokens_rows_and_latencies():
    m = ServerMetrics(("/v1/completions",))
    m.request("/v1/completions", 200)
    m.request("/v1/completions", 200)
    m.request("/v1/completions", 400)
    m.request("/no/such/route", 404)
    m.tokens(prompt=7)
    m.tokens(completion=3)
    m.first_token(0.02)
    m.per_token(0.3, count=3)  # three tokens 0.1 s apart
    load = {"running": 2, "waiting": 5, "finished": {}, "prefix_cache": {"entries": 2, "bytes": 4096},
            "prefill": {"prompts": 4, "prefix_hits": 3, "cached_tokens": 40, "prefilled_tokens": 12}}
    page = samples(m.text(load))
    assert page[("jaxformer_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 2
    assert page[("jaxformer_requests_total", (("route", "/v1/completions"), ("status", "400")))] == 1
    assert page[("jaxformer_requests_total", (("route", "other"), ("status", "404")))] == 1
    assert page[("jaxformer_prompt_tokens_total", ())] == 7
    assert page[("jaxformer_completion_tokens_total", ())] == 3
    assert page[("jaxformer_running_requests", ())] == 2 and page[("jaxformer_waiting_requests", ())] == 5
    assert page[("jaxformer_time_to_first_token_seconds_count", ())] == 1
    assert page[("jaxformer_time_to_first_token_seconds_bucket", (("le", "0.025"),))] == 1
    assert page[("jaxformer_time_to_first_token_seconds_bucket", (("le", "0.01"),))] == 0
    assert page[("jaxformer_time_per_output_token_seconds_count", ())] == 3
    assert page[("jaxformer_time_per_output_token_seconds_sum", ())] == pytest.approx(0.3)
    assert page[("jaxformer_time_per_output_token_seconds_bucket", (("le", "0.1"),))] == 3
    assert page[("jaxformer_prefix_cache_queries_total", ())] == 4
    assert page[("jaxformer_prefix_cache_hits_total", ())] == 3
    assert page[("jaxformer_prefix_cache_cached_tokens_total", ())] == 40
    assert page[("jaxformer_prefill_tokens_total", ())] == 12 and page[("jaxformer_prefix_cache_bytes", ())] == 4096
