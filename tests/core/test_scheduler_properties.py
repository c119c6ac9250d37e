"""The continuous scheduler passes the conformance kit under both policies; admission follows the policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.testing import check_scheduler, make_engine, request_st, run_requests


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_continuous_scheduler_conforms(policy):
    check_scheduler({"scheduler": {"name": "continuous", "policy": policy}}, priorities=policy == "priority")


@settings(max_examples=200, deadline=None)
@given(reqs=st.lists(request_st, min_size=2, max_size=12), num_blocks=st.integers(16, 60),
       max_seqs=st.integers(1, 6), policy=st.sampled_from(["fcfs", "priority"]))
def test_admission_follows_the_policy(reqs, num_blocks, max_seqs, policy):
    reqs = [(p, m, pr, f, 1) for p, m, pr, f, _ in reqs]  # one sequence each: the order is the requests'
    eng, order = make_engine({"scheduler": {"policy": policy}}, [], num_blocks, 64, max_seqs)
    run_requests(eng, reqs, priorities=policy == "priority")
    first = [int(rid[1:]) for rid in order]
    key = (lambda i: i) if policy == "fcfs" else (lambda i: (reqs[i][2], i))
    assert first == sorted(first, key=key), f"admission order {first} breaks {policy}"
