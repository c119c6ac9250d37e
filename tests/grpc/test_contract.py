"""The worker contract: the checked-in generated code is what worker.proto generates, every sampling field a backend
reads travels, a batch survives the round trip, and a worker answers malformed or stale calls with a status code
that names the problem (and keeps serving)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
import torch

from llmserve.batch import ModelOutput, ScheduledRequest, SchedulerOutput
from llmserve.config import config_from_dict
from llmserve.plugins import load_plugins
from llmserve.request import Logprob, SamplingParams
from llmserve_grpc import contract
from llmserve_grpc import worker_pb2 as pb
from llmserve_grpc import worker_pb2_grpc as pb_grpc
from llmserve_grpc.worker import start

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


def test_the_checked_in_code_is_what_the_proto_generates(tmp_path):
    grpc_tools = pytest.importorskip("grpc_tools")
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    assert protoc.main(["protoc", f"-I{PLUGINS}", f"-I{include}", f"--python_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", str(PLUGINS / "llmserve_grpc" / "worker.proto")]) == 0
    for name in ("worker_pb2.py", "worker_pb2_grpc.py"):
        checked_in = (PLUGINS / "llmserve_grpc" / name).read_text().splitlines(keepends=True)
        assert "".join(checked_in[3:]) == (tmp_path / "llmserve_grpc" / name).read_text(), name


def test_every_sampling_field_travels_or_is_the_servers():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    sent = {f.name for f in pb.Sampling.DESCRIPTOR.fields}
    assert sent | contract.SERVER_ONLY == fields and not sent & contract.SERVER_ONLY
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
                        frequency_penalty=-0.5, logit_bias={3: -100.0, 9: 2.5}, seed=-(2**63), stop_token_ids=[4],
                        ignore_eos=True, min_tokens=2, logprobs=0, prompt_logprobs=3, max_tokens=None)
    back = contract.sampling_from_proto(contract.sampling_to_proto(sp))
    assert {k: getattr(back, k) for k in sent} == {k: getattr(sp, k) for k in sent}


def _batch(held_ids: list[int]) -> SchedulerOutput:
    sp = SamplingParams(temperature=0.0, logprobs=1)
    reqs = [ScheduledRequest("a", held_ids, 0, len(held_ids), [0, 1], sp, False, len(held_ids), pooling="mean"),
            ScheduledRequest("b", [5, 6, 7], 2, 1, [2], sp, True, 2, num_output_tokens=1)]
    mask = torch.tensor([[-1] * 9], dtype=torch.int32)
    return SchedulerOutput(requests=reqs, num_prefill_tokens=len(held_ids), num_decode_tokens=1, block_size=4,
                           finished_request_ids=["gone"], token_bitmask=mask, bitmask_rows=[1])


def test_a_batch_and_its_answer_survive_the_round_trip():
    tokens = contract.SequenceTokens()
    tokens.tokens["gone"] = [1]
    batch = _batch([1, 2, 3, 4, 5])
    back = contract.batch_from_proto(contract.batch_to_proto(batch, "s", {}), tokens, vocab_size=257)
    assert "gone" not in tokens.tokens
    assert back.requests == batch.requests  # (the server-only sampling fields are at their defaults here)
    assert torch.equal(back.token_bitmask, batch.token_bitmask) and back.bitmask_rows == [1]
    # the next step sends only what the worker lacks
    batch.requests[1].token_ids.append(8)
    msg = contract.batch_to_proto(batch, "s", {"a": 5, "b": 3})
    assert [list(s.new_token_ids) for s in msg.requests] == [[], [8]]
    assert contract.batch_from_proto(msg, tokens, 257).requests[1].token_ids == [5, 6, 7, 8]
    out = ModelOutput([4, None], [Logprob(4, -0.25, 1, [(4, -0.25), (2, -3.0)]), None],
                      [None, [Logprob(6, -1.5, 2, []), None]], pooled=[None, [0.5, -1.25, 3.0]])
    assert contract.output_from_proto(contract.output_to_proto(out, 2), 2) == out


@pytest.fixture(scope="module")
def worker():
    """A worker hosting the fake backend in this process; a stub and its session."""
    cfg = config_from_dict({"backend": {"name": "fake"}, "server": {"host": "127.0.0.1", "port": 0}})
    server, port, _ = start(cfg, load_plugins())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ModelWorkerStub(channel)
    info = stub.Connect(pb.ConnectRequest(protocol=contract.PROTOCOL))
    session = stub.InitKvCache(pb.InitKvCacheRequest(num_blocks=64, block_size=4)).session
    yield stub, session, info
    channel.close()
    server.stop(0)


def test_the_worker_reports_its_model(worker):
    _, _, info = worker
    assert (info.backend, info.vocab_size, info.eos_token_id, list(info.eos_token_ids)) == ("fake", 257, 256, [256])


@pytest.mark.parametrize("change, code, words", [
    (lambda m: setattr(m, "session", "stale"), grpc.StatusCode.FAILED_PRECONDITION, "another server"),
    (lambda m: setattr(m.requests[0], "start", 99), grpc.StatusCode.FAILED_PRECONDITION,
     "this worker holds"),
    (lambda m: setattr(m.requests[0], "num_new_tokens", 2**40), grpc.StatusCode.INVALID_ARGUMENT, "computes up to"),
    (lambda m: (setattr(m, "token_bitmask", b"\x01\x02"), m.bitmask_rows.append(0)), grpc.StatusCode.INVALID_ARGUMENT,
     "token_bitmask"),
    (lambda m: m.bitmask_rows.append(7), grpc.StatusCode.INVALID_ARGUMENT, "token_bitmask"),
    (lambda m: m.requests[0].ClearField("block_table"), None, None),  # the fake backend reads no blocks
    # what the server checks of its own requests, from whoever reaches the port: 2M logprobs built 27 MB, and a
    # repeated id shrank the first's token ids after their check (an IndexError, INTERNAL)
    (lambda m: setattr(m.requests[0].sampling, "logprobs", 2_000_000), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (lambda m: m.requests[0].new_token_ids.append(10**12), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (lambda m: setattr(m.requests[0], "pooling", "bogus"), grpc.StatusCode.INVALID_ARGUMENT, "pooling"),
    (lambda m: setattr(m.requests[1], "request_id", m.requests[0].request_id), grpc.StatusCode.INVALID_ARGUMENT,
     "twice"),
])
def test_a_malformed_or_stale_step_gets_a_status_that_names_it(worker, change, code, words):
    stub, session, _ = worker
    msg = contract.batch_to_proto(_batch([1, 2, 3]), session, {})
    msg.requests[1].start = 0  # this worker holds nothing of "b" yet
    msg.ClearField("token_bitmask")
    del msg.bitmask_rows[:]
    change(msg)
    if code is None:
        assert len(stub.Execute(msg).results) == 2
    else:
        with pytest.raises(grpc.RpcError) as err:
            stub.Execute(msg)
        assert err.value.code() == code and words in err.value.details()
    good = contract.batch_to_proto(_batch([1, 2, 3]), session, {})
    good.requests[1].start = 0
    assert len(stub.Execute(good).results) == 2  # it still serves


@pytest.mark.parametrize("heading, module", [("backend: grpc", "llmserve_grpc.backend"),
                                             ("backend: onnx", "llmserve_onnx.backend")])
def test_the_backends_options_are_documented(heading, module):
    import importlib

    from tests.plugins.test_plugin_meta import _option_table, _yaml_default

    options = importlib.import_module(module).OPTIONS
    assert _option_table(heading) == {k: _yaml_default(v) for k, v in options.items()}
