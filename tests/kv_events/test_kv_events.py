"""`kvrelay run --kv-events`, judged by code kvrelay did not write: vLLM 0.33.0's own event
classes decode every frame (msgspec, typed: a frame that is not a valid `KVEventBatch` fails),
vLLM's encoder writes the same bytes back, vLLM's test suite's `MockSubscriber` (pyzmq, libzmq)
receives and replays, and vLLM's own `hash_block_tokens` recomputes every published block hash
from the published tokens.

Env: KVRELAY_BIN  the kvrelay binary (default: target/ci, release or debug, whichever exists)
     VLLM_SRC     an unpacked vllm-0.33.0 source tree (tests/kv_events/run.sh provides one)
"""

import json
import os
import pathlib
import socket
import subprocess
import time

import msgspec
import pytest
import zmq

import vllm_code

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM = vllm_code.src_root()
EV = vllm_code.load_kv_events(VLLM)
HASHING = vllm_code.Hashing(VLLM)
MockSubscriber = vllm_code.mock_subscriber(VLLM, zmq, msgspec)


def kvrelay_bin():
    if os.environ.get("KVRELAY_BIN"):
        return os.environ["KVRELAY_BIN"]
    for p in ("target/ci/kvrelay", "target/release/kvrelay", "target/debug/kvrelay"):
        if (ROOT / p).exists():
            return str(ROOT / p)
    pytest.fail("no kvrelay binary: build it or set KVRELAY_BIN")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """A `kvrelay run` whose PUB socket connects to vLLM's subscriber, bound first (vLLM's
    `tcp://HOST:PORT` form): kvrelay publishes only once connected, so the live stream misses
    at most what ZMQ's subscription handshake races with (a run of 60 requests takes 0.2 s,
    less than a subscriber's reconnect interval: a bound publisher would be done before the
    subscriber found it). The replay socket is bound by kvrelay, as always."""

    def __init__(self, *args, topic="kvrelay", linger=8):
        self.pub, self.replay = free_port(), free_port()
        self.sub = MockSubscriber(
            [],
            [f"tcp://127.0.0.1:{self.replay}"],
            topic,
            decode_type=EV.KVEventBatch,
        )
        self.sub.sub.bind(f"tcp://127.0.0.1:{self.pub}")
        self.sub.decoder = msgspec.msgpack.Decoder(type=EV.KVEventBatch)
        self.raw = {}
        cmd = [
            kvrelay_bin(), "run", "--json", *args,
            "--kv-events", f"tcp://127.0.0.1:{self.pub}",
            "--kv-events-replay", f"tcp://*:{self.replay}",
            "--kv-events-topic", topic,
            "--kv-events-linger", str(linger),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def live(self, quiet_s=3.0, limit_s=120):
        """Receives until the stream, once started, has been quiet for `quiet_s` (the run's
        steps are done)."""
        deadline = time.time() + limit_s
        last = None
        while time.time() < deadline and (last is None or time.time() - last < quiet_s):
            if last is None and self.proc.poll() is not None:
                break
            if self.sub.sub.poll(200):
                topic, seq, payload = self.sub.sub.recv_multipart()
                assert topic == b"kvrelay"
                n = int.from_bytes(seq, "big")
                self.raw[n] = payload
                self.sub.received_msgs.append((n, self.sub.decoder.decode(payload)))
                last = time.time()
        return self.sub.received_msgs

    def report(self):
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err[-2000:]
        return json.loads(out)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sub.close()


@pytest.fixture(scope="module")
def run():
    # The generated workload on a small GPU pool: prefix hits, evictions, preemptions, CPU
    # stores and loads all happen.
    r = Run("--requests", "60", "--gpu-blocks", "200", "--cpu-blocks", "400")
    try:
        live = r.live()
        r.sub.request_replay(0)
        replayed = r.sub.receive_replay()
        yield r, live, replayed
    finally:
        r.close()


def test_every_frame_decodes_with_vllms_classes_and_reencodes_byte_for_byte(run):
    r, live, replayed = run
    assert live, "nothing received live"
    for seq, batch in live:
        assert isinstance(batch, EV.KVEventBatch)
        assert batch.data_parallel_rank == 0
        assert batch.events, f"batch {seq} is empty (vLLM publishes none then)"
        assert msgspec.msgpack.encode(batch) == r.raw[seq], f"batch {seq} re-encodes differently"
        for e in batch.events:
            assert isinstance(e, (EV.BlockStored, EV.BlockRemoved, EV.AllBlocksCleared))


def test_sequence_numbers_are_consecutive_and_replay_answers_from_zero(run):
    r, live, replayed = run
    seqs = [s for s, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a live gap"
    assert [s for s, _ in replayed] == list(range(len(replayed))), "replay must start at 0"
    assert replayed[-1][0] >= seqs[-1]
    by_seq = dict(replayed)
    for s, b in live:
        assert by_seq[s] == b, f"replayed batch {s} differs from the live one"


def test_replay_from_a_given_sequence(run):
    r, live, replayed = run
    start = len(replayed) // 2
    r.sub.request_replay(start)
    again = r.sub.receive_replay()
    assert [s for s, _ in again] == list(range(start, len(replayed)))


def test_published_hashes_are_vllms_for_the_published_tokens(run):
    """Every GPU BlockStored's hashes are vLLM's `hash_block_tokens` chain over its tokens,
    from its parent (whose full digest an earlier BlockStored gave) or from NONE_HASH."""
    _, _, replayed = run
    full = {}  # published 64-bit hash -> vLLM's 32-byte digest
    checked = 0
    for _, batch in replayed:
        for e in batch.events:
            if not isinstance(e, EV.BlockStored) or e.medium != "GPU":
                continue
            assert e.block_size > 0 and len(e.token_ids) == e.block_size * len(e.block_hashes)
            prev = None if e.parent_block_hash is None else full[e.parent_block_hash]
            for i, h in enumerate(e.block_hashes):
                toks = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
                d = HASHING.hash_block_tokens(HASHING.sha256, prev, toks, None)
                assert HASHING.external(d) == h, f"block {i} of a BlockStored"
                full[h] = d
                prev = d
                checked += 1
    assert checked > 100


def test_events_tell_a_consistent_cache_story(run):
    """Replayed into a model cache (a multiset per medium), no block is removed that was not
    stored, the GPU cache never holds more blocks than the pool, and the CPU events count the
    chunks the ranks stored."""
    r, _, replayed = run
    report = r.report()
    held = {"GPU": {}, "CPU": {}}
    stored_cpu = 0
    for _, batch in replayed:
        for e in batch.events:
            if isinstance(e, EV.AllBlocksCleared):
                held["GPU"].clear()
                continue
            m = held[e.medium]
            if isinstance(e, EV.BlockStored):
                stored_cpu += e.medium == "CPU"
                for h in e.block_hashes:
                    m[h] = m.get(h, 0) + 1
            else:
                for h in e.block_hashes:
                    assert m.get(h, 0) > 0, f"{e.medium} removal of a hash never stored"
                    m[h] -= 1
            assert sum(held["GPU"].values()) <= report["gpu_blocks"] - 1
    assert report["kv_events"]["batches"] == len(replayed)
    assert report["kv_events"]["replays"] >= 1
    # Each rank stores each offloaded block once; the manager announces each stored key once.
    assert stored_cpu * report["ranks"] == report["blocks_offloaded"]
    assert any(e.medium == "GPU" for _, b in replayed for e in b.events if isinstance(e, EV.BlockRemoved))
    assert any(e.medium == "CPU" for _, b in replayed for e in b.events if isinstance(e, EV.BlockRemoved))
