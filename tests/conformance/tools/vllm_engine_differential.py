#!/usr/bin/env python3
"""Differential testing of kvrelay's `engine` machine (SCRIPTED connector) against vLLM 0.33.0.

Random conformance cases (FORMAT.md, machine `engine`, scripted connector, compat mode) are built
call by call while driving a LIVE oracle engine (vllm_engine_ref.Engine: vLLM's real Scheduler /
AsyncScheduler, KVCacheManager, coordinator, BlockPool, Request, with a scripted connector). Every
call is chosen from vLLM's current state -- `finished_recving` only for a request whose async load
was scheduled (it appeared in a schedule's meta.loads) and not reported yet, `finished_sending` only
for a finished request whose free was delayed and that is still held, `invalid_block_ids` from the
blocks of loads scheduled in the applied step or earlier (single KV group only), lookups that keep
the connector contract (local hit + external <= prompt; the local hit is bounded from the token
sequences the cache can hold), ... -- and its result is recorded as `expect` / `expect_error` exactly
as `vllm_engine_ref.py --fill` writes it. kvrelay then replays the cases (`kvrelay conformance`).

Commands
  generate N DIR [--seed S] [--mix NAME]
        Write N cases DIR/case-<S>-<i>.json with vLLM's results as expectations, plus DIR/MIX.json
        (profiles and the features that actually happened, per case). Use it to build a corpus to
        inspect, keep, or run later with `kvrelay conformance DIR`.
  run N DIR [--seed S] [--mix NAME] [--kvrelay PATH]
        generate, then run `kvrelay conformance` on the cases and summarise (cases, passed, failed;
        failures grouped by the kind of their first differing call). Exit status 1 on any failure.
        The everyday command after a change to kvrelay's scheduler.
  replay CASE|DIR...
        Run existing cases through the oracle and print OK/BAD per case with the first differing
        call (the same check as vllm_engine_ref.py, with this tool's crash handling). Use it to check
        that a hand-edited or shrunk case still agrees with vLLM.
  shrink CASE [--out PATH] [--kvrelay PATH]
        Delta-debug one failing case: drop requests, then calls, while kvrelay still fails at the
        same kind of call; the oracle re-fills the expectations after every change. Use it on a FAIL
        of `run` to get a small reproduction.
  regen SEED INDEX DIR
        Regenerate the single case INDEX of seed SEED (the case name carries both) into DIR,
        without the hash-seed check.

--mix NAME restricts generation to one profile (default `all`: the weighted mix; see PROFILES).
Cases are generated under PYTHONHASHSEED=0 in worker subprocesses, then re-run by the oracle under
other hash seeds (--hash-seeds, default 1,2,3; 0 is replayed too, to catch state leaking between cases
of one process) and truncated before the first call whose result differs; a truncated case with
fewer than 3 `schedule` calls left is dropped. A call that makes vLLM assert in a way kvrelay has no
kind for (`internal_assert:...`), or crash, is cut from the case; the case up to and including it is
saved to DIR-asserts/. Other sticky errors (completion_for_live_request, stale_completion,
connector_contract, ...) end the case right after the call.

Same --seed => same cases (case i uses random.Random(seed * 1000003 + i)).
The oracle lives in <repo>/../shared/tools/vllm-oracle (override: env VLLM_ORACLE).
"""
import argparse, collections, json, os, random, re, subprocess, sys, tempfile, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
ORACLE = os.environ.get("VLLM_ORACLE") or os.path.abspath(os.path.join(REPO, "..", "shared", "tools", "vllm-oracle"))
DEFAULT_KVRELAY = os.path.join(REPO, "target", "release", "kvrelay")
GEN_HASHSEED = "0"
MIN_SCHEDULES = 3
MIN_WINDOW = int(os.environ.get("ENGINE_DIFF_MIN_WINDOW", "1"))   # --min-window, passed to the workers

STICKY = {"completion_for_live_request", "stale_completion", "duplicate_completion", "connector_contract",
          "intent_rejected", "internal_assert"}

# profile -> weight in the `all` mix
PROFILES = {
    "prefix": 8,        # arrivals over time with shared prefixes; misses and sync hits
    "loads": 12,        # async / sync / pending lookups, completions
    "preempt": 20,      # small pools: preemption and resume
    "hitload": 19,      # two groups / sliding window: local hit + external tokens in one admission
    "depth2fail": 14,   # async depth 2 with load failures
    "failures": 8,      # load failures (invalid blocks, failed_recving), depth 1
    "delayed": 8,       # delayed frees, finish params, pending block frees, push work
    "aborts": 5,        # aborts in every state
    "mixed": 6,         # everything at once
}


def is_sticky(kind):
    return kind in STICKY or kind.startswith("internal_assert")


# =============================================================================================
# Oracle side (imported only in worker processes)

_O = None


def oracle():
    global _O
    if _O is None:
        sys.path.insert(0, ORACLE)
        import io, contextlib
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            import vllm_engine_ref as O  # noqa
        import logging
        logging.disable(logging.CRITICAL)
        _O = O
    return _O


def jcopy(v):
    return json.loads(json.dumps(v))


def crash_kind(e):
    import traceback
    tb = [f for f in traceback.extract_tb(e.__traceback__) if "vllm-ref" in f.filename] or \
        traceback.extract_tb(e.__traceback__)
    return "internal_assert:exception:%s:%s:%d:%s" % (type(e).__name__, os.path.basename(tb[-1].filename),
                                                      tb[-1].lineno, tb[-1].name)


def call_engine(eng, call, args):
    """One call on an oracle Engine: ('value', v) or ('error', kind); a crash is a sticky internal_assert."""
    O = oracle()
    fn = getattr(eng, call, None)
    if fn is None:
        return ("error", "unknown_call:" + call)
    try:
        return ("value", jcopy(fn(jcopy(args or {}))))
    except O.CaseErr as e:
        return ("error", e.kind)
    except Exception as e:      # vLLM's code crashed (not an assertion): treated like one
        k = crash_kind(e)
        eng.sticky = k
        return ("error", k)


def lcp(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Gen:
    """Builds one case against a live oracle Engine."""

    def __init__(self, seed, idx, mix="all"):
        self.seed, self.idx = seed, idx
        self.rng = random.Random(seed * 1_000_003 + idx)
        self.O = oracle()
        self.mix = mix

    def reset(self):
        self.calls = []
        self.events = []        # (call index, feature key, count)
        self.errors = collections.Counter()
        self.done = False
        self.assert_info = None

    def ev(self, key, n=1):
        if n:
            self.events.append((len(self.calls) - 1, key, n))

    # -- config ------------------------------------------------------------------------------
    def gen_config(self):
        rng = self.rng
        if self.mix == "all":
            prof = rng.choices(list(PROFILES), list(PROFILES.values()))[0]
        else:
            prof = self.mix
        self.prof = prof
        K = self.knobs = {
            "p_async": 0.15, "p_sync": 0.15, "p_pending": 0.05, "p_miss_explicit": 0.1,
            "p_delay": 0.05, "abort_w": 0.2, "p_failed_recving": 0.03, "p_invalid": 0.03,
            "p_recv": 0.5, "p_send": 0.45, "families": True, "warm": 0.3, "p_set_misc": 0.05,
        }
        groups = ["full"]
        depth = 1 if rng.random() < 0.75 else 2
        pressure = rng.random() < 0.3
        policy = None
        if rng.random() < 0.3:
            policy = rng.choice(["fail", "recompute"])
        if prof == "prefix":
            K.update(p_async=0.05, p_sync=0.25, p_pending=0.02, warm=0.5)
        elif prof == "loads":
            K.update(p_async=0.45, p_sync=0.2, p_pending=0.15, p_failed_recving=0.03, p_invalid=0.03)
        elif prof == "preempt":
            pressure = True
            K.update(p_async=0.25, p_sync=0.15, p_pending=0.05, abort_w=0.1, warm=0.15)
        elif prof == "hitload":
            groups = rng.choice([["full", "full"], ["full", "full"], ["full", {"sliding_window": 0}],
                                 ["full", {"sliding_window": 0}], ["full", {"sliding_window": 0}],
                                 [{"sliding_window": 0}], [{"sliding_window": 0}, "full"]])
            K.update(p_async=0.45, p_sync=0.35, p_pending=0.05, warm=0.9)
            pressure = rng.random() < 0.3
        elif prof == "depth2fail":
            depth = 2
            policy = rng.choice(["fail", "recompute"])
            K.update(p_async=0.5, p_sync=0.3, p_pending=0.05, p_failed_recving=0.15, p_invalid=0.25, warm=0.5)
            pressure = rng.random() < 0.25
        elif prof == "failures":
            policy = rng.choice(["fail", "recompute"])
            K.update(p_async=0.45, p_sync=0.3, p_failed_recving=0.15, p_invalid=0.25, warm=0.5)
        elif prof == "delayed":
            K.update(p_delay=0.5, p_set_misc=0.2, p_send=0.35, p_async=0.2)
        elif prof == "aborts":
            K.update(abort_w=1.2, p_async=0.35, p_delay=0.3, p_pending=0.1)
        elif prof == "mixed":
            K.update(p_async=0.3, p_sync=0.2, p_pending=0.1, p_delay=0.25, abort_w=0.4, p_failed_recving=0.08,
                     p_invalid=0.1, p_set_misc=0.1)
            pressure = rng.random() < 0.4
            depth = rng.choice([1, 2])
        if prof not in ("hitload",) and rng.random() < 0.25:
            groups = rng.choice([["full", "full"], ["full", {"sliding_window": 0}], [{"sliding_window": 0}]])
        r = rng.random()
        bs = 4 if r < 0.45 else 16 if r < 0.7 else rng.randint(1, 16)
        if pressure and rng.random() < 0.7:
            bs = rng.choice([2, 4, 4, 4, 8])
        groups = [{"sliding_window": rng.randint(1, 64)} if g != "full" else g for g in groups]
        groups = [{"sliding_window": max(g["sliding_window"], MIN_WINDOW)} if g != "full" else g for g in groups]
        ng = len(groups)
        max_prompt = rng.choice([8, 16, 24, 40, 64, 100, 200])
        if pressure:
            max_prompt = rng.choice([16, 24, 40, 64])
        if bs == 1:
            max_prompt = min(max_prompt, 64)
        max_new = rng.randint(1, 8) if not pressure else rng.randint(3, 8)
        self.max_prompt, self.max_new = max_prompt, max_new
        self.long_prompts = pressure and rng.random() < (0.8 if prof == "preempt" else 0.5)
        cfg = {}
        if bs != 16 or rng.random() < 0.3:
            cfg["block_size"] = bs
        if groups != ["full"] or rng.random() < 0.1:
            cfg["groups"] = groups
        per_req = -(-(max_prompt + max_new) // bs)      # blocks of one request, per group
        if pressure:
            nblocks = 1 + ng * int(per_req * rng.uniform(1.0, 1.6) + 0.999)
            cfg["num_gpu_blocks"] = nblocks
        else:
            nblocks = min(2000, 1 + ng * per_req * rng.randint(3, 10))
            if nblocks != 64 or rng.random() < 0.5:
                cfg["num_gpu_blocks"] = nblocks
        self.nblocks = nblocks
        chunked = rng.random() < 0.85
        if not chunked:
            cfg["enable_chunked_prefill"] = False
        mbt = rng.choice([4, 8, 16, 32, 64, 256, 512])
        if pressure and rng.random() < 0.7:
            mbt = rng.choice([4, 8, 12, 16, 24, 32])
        if not chunked and rng.random() < 0.8:
            mbt = max(mbt, max_prompt + max_new + 8)
        if mbt != 256 or rng.random() < 0.2:
            cfg["max_num_batched_tokens"] = mbt
        mns = rng.choice([1, 2, 3, 4, 8, 16, 16] if prof != "preempt" else [2, 3, 4, 8, 16])
        if mns != 16:
            cfg["max_num_seqs"] = mns
        self.max_model_len = 1024
        if rng.random() < 0.06:
            self.max_model_len = max_prompt + rng.randint(1, 4)
            cfg["max_model_len"] = self.max_model_len
        if rng.random() < 0.1:
            cfg["enable_prefix_caching"] = False
        if rng.random() < 0.12:
            cfg["long_prefill_token_threshold"] = rng.choice([1, 2, 4, 8, 16, 32])
        if pressure and chunked and rng.random() < 0.6:
            # short chunks for everybody: several prefills grow at once until the pool runs out
            cfg["long_prefill_token_threshold"] = rng.choice([2, 4, 4, 8, 8, 12])
            cfg["max_num_batched_tokens"] = rng.choice([16, 24, 32, 64])
            if cfg.get("max_num_seqs", 16) < 3:
                cfg["max_num_seqs"] = rng.choice([3, 4, 8])
        if rng.random() < 0.1 and not pressure:
            cfg["watermark_blocks"] = rng.randint(1, 3)
        if policy is not None:
            cfg["load_failure_policy"] = policy
        if depth > 1:
            cfg["async_depth"] = depth
        if rng.random() < 0.1:
            cfg["requires_kv_delivery"] = True
        self.cfg = cfg
        self.bs, self.ng, self.depth, self.groups = bs, ng, depth, groups
        self.pc = cfg.get("enable_prefix_caching", True)
        self.swa = any(g != "full" for g in groups)
        self.pressure = pressure
        return cfg

    # -- helpers -----------------------------------------------------------------------------
    def toks(self, n):
        return [self.rng.randint(1, 999) for _ in range(n)]

    def make_prompt(self):
        rng = self.rng
        limit = max(1, min(self.max_prompt, self.max_model_len - 1))
        if self.long_prompts and rng.random() < 0.8:
            p = rng.choice(self.families)
            toks = p + self.toks(rng.randint(0, max(0, limit - len(p))))
            return toks[:limit]
        if self.families and rng.random() < 0.8:
            p = rng.choice(self.families)
            r = rng.random()
            k = len(p) if r < 0.5 else (rng.randint(1, max(1, len(p) // self.bs)) * self.bs if r < 0.8
                                        else rng.randint(1, len(p)))
            extra = rng.choice([0, 1, 2, self.bs, self.bs + 1, rng.randint(1, 40)])
            toks = p[:k] + self.toks(extra)
        else:
            toks = self.toks(rng.randint(1, limit))
        return toks[:limit]

    def R(self, rid):
        return self.eng.s.requests.get(rid)

    def live(self):
        return [rid for rid, r in self.eng.s.requests.items() if not r.is_finished()]

    def status(self, rid):
        r = self.R(rid)
        if r is None:
            return None
        return self.O.STATUS[r.status]

    def fresh_id(self):
        self.nid += 1
        return "r%d" % (self.nid - 1)

    def hit_ub(self, rid, r):
        """Upper bound of the local prefix hit vLLM can find for request r now or later (until a
        sequence the cache can hold grows): the longest common prefix with any known token sequence,
        at most num_tokens - 1, floored to the block size."""
        if not self.pc:
            return 0
        toks = list(r.all_token_ids)
        best = 0
        for key, s in self.seqs.items():
            if key == (rid, self.inc[rid]) and rid not in self.admitted:
                continue
            best = max(best, lcp(toks, s))
        best = min(best, len(toks) - 1)
        return best - best % self.bs

    def refresh_seqs(self):
        for rid, r in self.eng.s.requests.items():
            self.seqs[(rid, self.inc[rid])] = list(r.all_token_ids)

    def choose_lookup(self, rid, n, ub, allow_pending=True):
        """A lookup answer for request rid of n tokens whose local hit is at most ub."""
        rng, K = self.rng, self.knobs
        self.broken.discard(rid)
        if self.break_contract:
            # once per chosen case: an answer that may break the connector contract (async 0, or
            # beyond the request); the fixer leaves it alone
            self.break_contract = False
            self.broken.add(rid)
            return rng.choice([{"tokens": 0, "async": True}, {"tokens": n - ub + rng.randint(0, 2)},
                               {"tokens": n - ub + 1, "async": True}])
        x = rng.random()
        if allow_pending and x < K["p_pending"]:
            return None
        x = rng.random()
        room_async = n - ub
        room_sync = n - 1 - ub
        if x < K["p_async"] and room_async >= 1:
            t = room_async if rng.random() < 0.4 else rng.randint(1, room_async)
            return {"tokens": t, "async": True}
        x = rng.random()
        if x < K["p_sync"] and room_sync >= 1:
            t = room_sync if rng.random() < 0.3 else rng.randint(1, room_sync)
            return {"tokens": t} if rng.random() < 0.7 else {"tokens": t, "async": False}
        return {"tokens": 0}

    # -- one call ----------------------------------------------------------------------------
    def do(self, call, args=None):
        c = {"call": call}
        if args:
            c["args"] = args
        pre = self.pre_call(call, args or {})
        kind, v = call_engine(self.eng, call, args or {})
        if kind == "value":
            c["expect"] = v
        else:
            c["expect_error"] = v
        ok = kind == "value"
        if ok and call == "apply_output" and sum(1 for o in v["outputs"] if o["finish"] == "error") > 1:
            # vLLM finishes the requests of a failed load in set (hash) order: the output order and
            # the later free-queue order depend on PYTHONHASHSEED. End the case before this call.
            self.ev("cut_multi_error")
            self.done = True
            return False, "cut"
        if not ok and v.startswith("internal_assert"):
            self.assert_info = {"call": call, "args": args, "kind": v, "index": len(self.calls)}
            self.calls.append(c)
            self.done = True
            return ok, v
        self.calls.append(c)
        self.post_call(call, args or {}, ok, v, pre)
        if not ok:
            self.errors[v] += 1
            self.ev("error:" + v)
            if is_sticky(v):
                self.done = True
                self.ev("sticky:" + v)
        return ok, v

    def pre_call(self, call, a):
        if call in ("abort",):
            r = self.R(a["id"])
            if r is None:
                return "unknown" if a["id"] not in self.inc else "freed"
            if r.is_finished():
                return "finished_held"
            return self.O.STATUS[r.status]
        return None

    def process_log(self, entries):
        for e in entries:
            c = e["call"]
            if c == "get_num_new_matched_tokens":
                self.last_lookup[e["id"]] = e
                if e["answer"] is None:
                    self.asked_pending.add(e["id"])
                    self.ev("lookup_pending_asked")
                elif e["answer"]["tokens"] > 0:
                    self.ev("lookup_hit_answer")
                if e["num_computed_tokens"] > 0:
                    self.ev("local_hit")
            elif c == "update_state_after_alloc":
                if e["num_external_tokens"] > 0:
                    lk = self.last_lookup.get(e["id"])
                    if lk is not None and lk["num_computed_tokens"] > 0:
                        self.ev("hit_and_load")
                        if self.ng == 2:
                            self.ev("two_groups_hit_and_load")
                        if self.swa:
                            self.ev("swa_hit_and_external")
            elif c == "request_finished":
                if e["delay_free"]:
                    self.send_held.add(e["id"])
                    self.ev("delayed_free")

    def sync_log(self, call, v):
        log = self.eng.connector.log
        if call == "connector_calls":
            self.process_log(v[self.logpos:])
            self.logpos = 0
        else:
            self.process_log(log[self.logpos:])
            self.logpos = len(log)

    def post_call(self, call, a, ok, v, pre):
        self.ev("call:" + call)
        self.sync_log(call, v if ok else None)
        if not ok:
            if call == "apply_output" and v == "step_out_of_order":
                pass
            return
        if call == "schedule":
            self.ev("steps")
            if v["preempted_req_ids"]:
                self.ev("preemption", len(v["preempted_req_ids"]))
            if v["resumed"]:
                self.ev("resumed", len(v["resumed"]))
            for rid in v["new"] + v["resumed"]:
                self.admitted.add(rid)
            for ld in v["meta"]["loads"]:
                self.admitted.add(ld["id"])
                self.loads.append((v["step"], ld))
                if ld["async"]:
                    self.recv_pending[ld["id"]] = v["step"]
                    self.ev("async_load")
                else:
                    self.ev("sync_load")
            if v["has_sync_kv_loads"]:
                self.ev("has_sync_kv_loads")
        elif call == "apply_output":
            self.refresh_seqs()
            for o in v["outputs"]:
                if o["finish"]:
                    self.ev("finish_" + o["finish"])
                if o["kv_transfer_params"] is not None:
                    self.ev("kv_transfer_params_out")
            fr = a.get("finished_recving") or []
            fs = a.get("finished_sending") or []
            for rid in fr:
                if self.recv_pending.pop(rid, None) is not None:
                    self.recv_reported.add(rid)
            for rid in fs:
                self.send_held.discard(rid)
            self.ev("finished_recving", len(fr))
            self.ev("finished_sending", len(fs))
            if a.get("failed_recving"):
                self.ev("failed_recving")
                if self.depth > 1:
                    self.ev("depth2_load_failure")
            if a.get("invalid_block_ids"):
                self.ev("invalid_block_ids")
                if self.depth > 1:
                    self.ev("depth2_load_failure")
            if a.get("no_kv_output"):
                self.ev("no_kv_output")
            if a.get("sampled"):
                self.ev("sampled_override")
        elif call == "abort":
            if v:
                self.ev("abort_" + pre)
                r = self.R(a["id"])
                if r is not None:
                    self.ev("abort_held")
            else:
                self.ev("abort_false")
        elif call == "add_request":
            self.ev("requests")
        elif call == "set_lookup":
            self.asked_pending.discard(a["id"])
            if a["lookup"] is not None and a["id"] in self.pending_set:
                self.ev("pending_resolved")
            self.pending_set.discard(a["id"])
        # forget bookkeeping of requests vLLM no longer holds
        for rid in list(self.recv_pending):
            if rid not in self.eng.s.requests:
                del self.recv_pending[rid]
        for rid in list(self.send_held):
            if rid not in self.eng.s.requests:
                self.send_held.discard(rid)

    # -- the case ----------------------------------------------------------------------------
    def build(self):
        self.reset()
        rng = self.rng
        cfg = self.gen_config()
        self.eng = self.O.Engine(jcopy(cfg))
        self.nid = 0
        self.logpos = 0
        self.inc = {}                   # rid -> incarnation number
        self.seqs = {}                  # (rid, incarnation) -> token sequence
        self.admitted = set()
        self.loads = []                 # (step, meta load)
        self.recv_pending = {}          # rid -> step of its async load, not reported yet
        self.send_held = set()          # finished with delay_free, not reported yet
        self.recv_reported = set()      # loads reported finished (for repeated reports)
        self.last_lookup = {}
        self.asked_pending = set()
        self.pending_set = set()
        self.stops = {}
        self.break_contract = False
        self.broken = set()
        self.named_ghost = False
        fam_n = rng.randint(1, 3)
        lo = max(1, min(self.bs, self.max_prompt))
        if self.long_prompts:
            lo = max(lo, self.max_prompt * 2 // 3)
        self.families = [self.toks(rng.randint(lo, self.max_prompt)) for _ in range(fam_n)]
        max_reqs = rng.randint(2, 10) if self.prof != "preempt" else rng.randint(3, 10)
        n_calls = rng.randint(15, 120)
        self.added = 0
        err_rate = 0.025
        if rng.random() < 0.02:
            self.break_contract = True
        if self.knobs["warm"] > rng.random():
            self.warmup()
        if self.pressure and rng.random() < 0.6:
            # a burst of arrivals that cannot all fit
            for _ in range(rng.randint(2, 4)):
                if not self.done and self.added < max_reqs:
                    self.c_add()
            n_calls += 30
        while not self.done and len(self.calls) < n_calls:
            if rng.random() < err_rate:
                self.typed_error()
                continue
            self.step_choice(max_reqs)
        if not self.done and rng.random() < 0.5:
            self.quiesce()
        name = "engine-diff seed %d #%d: %s bs=%d blocks=%d groups=%s%s%s" % (
            self.seed, self.idx, self.prof, self.bs, self.nblocks,
            "+".join("full" if g == "full" else "swa%d" % g["sliding_window"] for g in self.groups),
            " depth2" if self.depth > 1 else "",
            " " + cfg["load_failure_policy"] if "load_failure_policy" in cfg else "")
        if self.mix != "all" or MIN_WINDOW != 1:
            name += " [--mix %s --min-window %d]" % (self.mix, MIN_WINDOW)
        self.ev("profile:" + self.prof)
        return {"name": name, "machine": "engine", "config": cfg, "calls": self.calls}

    def warmup(self):
        """One or two requests of the prefix families run to completion first, so that later
        requests hit the GPU prefix cache (and can combine a local hit with external tokens)."""
        rng = self.rng
        for _ in range(rng.randint(1, 2)):
            if self.done:
                return
            fam = rng.choice(self.families)
            self.c_add(prompt=(fam + self.toks(rng.randint(0, 8)))[:max(1, min(self.max_prompt, self.max_model_len - 1))],
                       lookup=False)
        for _ in range(40):
            if self.done or not self.eng.s.has_requests():
                break
            self.c_schedule_or_apply()

    def c_schedule_or_apply(self):
        eng = self.eng
        if len(eng.in_flight) < self.depth and (not eng.in_flight or self.rng.random() < 0.6):
            self.c_schedule()
        elif eng.in_flight:
            self.c_apply()
        else:
            self.c_schedule()

    def step_choice(self, max_reqs):
        rng, eng, K = self.rng, self.eng, self.knobs
        inf = eng.in_flight
        live = self.live()
        opts = []
        if self.added < max_reqs:
            opts.append(("add", 3 if not live else 1.5))
        if len(inf) < self.depth:
            opts.append(("schedule", 4 if (self.depth > 1 and len(inf) == 1) else 3))
        if inf:
            opts.append(("apply", 3 if len(inf) >= self.depth else 1.5))
        if live:
            opts.append(("abort", K["abort_w"]))
        if self.send_held:
            opts.append(("abort_held", 0.1))
        opts.append(("abort_dead", 0.03))
        if self.asked_pending:
            opts.append(("resolve", 1.0))
        opts.append(("set_lookup", 0.15))
        opts.append(("set_misc", K["p_set_misc"] * 4))
        opts.append(("state", 0.3))
        opts.append(("request", 0.35))
        opts.append(("connector_calls", 0.25))
        kind = rng.choices([o[0] for o in opts], [o[1] for o in opts])[0]
        getattr(self, "c_" + kind)()

    # -- call makers ---------------------------------------------------------------------------
    def c_add(self, prompt=None, lookup=True):
        rng, K = self.rng, self.knobs
        rid = self.fresh_id()
        # an id vLLM no longer holds, and that no step in flight scheduled: vLLM keys its in-flight
        # accounting by id, so re-adding an id under a step of its previous incarnation applies that
        # step to the new request (ids are unique in vLLM; out of scope here)
        in_flight = {e[0] for st in self.eng.in_flight for e in st[2]}
        gone = [x for x in self.inc if x not in self.eng.s.requests and x not in in_flight]
        if gone and rng.random() < 0.04:
            rid = rng.choice(sorted(gone))
            self.ev("id_reuse")
        a = {"id": rid}
        if prompt is not None:
            a["prompt"] = prompt
        elif rng.random() < 0.12:
            a["prompt_len"] = rng.randint(1, max(1, min(self.max_prompt, self.max_model_len - 1)))
        else:
            a["prompt"] = self.make_prompt()
        toks = a["prompt"] if "prompt" in a else self.O.generated_prompt(rid, a["prompt_len"])
        a["max_tokens"] = rng.randint(1, self.max_new)
        if rng.random() < 0.15:
            a["stop_token"] = rng.randint(1, 999)
            self.stops[rid] = a["stop_token"]
        else:
            self.stops.pop(rid, None)
        if lookup:
            # bound the local hit with the sequences known now; the fixer before each schedule
            # corrects the script if the bound grows
            best = 0
            if self.pc:
                for key, s in self.seqs.items():
                    best = max(best, lcp(toks, s))
            best = min(best, len(toks) - 1)
            ub = best - best % self.bs
            r = rng.random()
            if r < 0.75:
                lk = self.choose_lookup(rid, len(toks), ub)
                if lk is not None or rng.random() < 0.9:
                    if lk == {"tokens": 0} and rng.random() > K["p_miss_explicit"]:
                        pass
                    else:
                        a["lookup"] = lk
        if rng.random() < K["p_delay"]:
            a["delay_free"] = True
        elif rng.random() < 0.03:
            a["delay_free"] = False
        self.added += 1
        ok, v = self.do("add_request", a)
        if ok:
            self.inc[rid] = self.inc.get(rid, -1) + 1
            self.admitted.discard(rid)
            self.seqs[(rid, self.inc[rid])] = list(toks)
            self.recv_pending.pop(rid, None)
            self.recv_reported.discard(rid)
            self.send_held.discard(rid)
            self.asked_pending.discard(rid)
            if a.get("lookup", 1) is None:
                self.pending_set.add(rid)
            else:
                self.pending_set.discard(rid)

    def fix_lookups(self):
        """Before a schedule: every request vLLM will look up (waiting/preempted, nothing computed)
        gets a script that keeps the contract, given the local hit's current upper bound."""
        eng = self.eng
        for rid, r in list(eng.s.requests.items()):
            if self.done:
                return
            if r.is_finished() or r.num_computed_tokens != 0:
                continue
            if r.status not in (self.O.RequestStatus.WAITING, self.O.RequestStatus.PREEMPTED):
                continue
            ans = eng.connector.lookups.get(rid, (0, False))
            if ans is None:
                continue
            t, asy = ans
            if t == 0 and not asy:
                continue
            n = r.num_tokens
            ub = self.hit_ub(rid, r)
            ok = (t > 0 and ub + t <= n) if asy else (ub + t <= n - 1)
            if ok:
                continue
            if rid in self.broken:
                self.ev("contract_break_kept")
                continue
            lk = self.choose_lookup(rid, n, ub, allow_pending=False)
            self.do("set_lookup", {"id": rid, "lookup": lk})
            self.ev("lookup_fixed")

    def c_schedule(self):
        self.fix_lookups()
        if not self.done:
            self.do("schedule")

    def step_loads(self, step, rid=None):
        return [ld for s, ld in self.loads if s <= step and (rid is None or ld["id"] == rid)]

    def c_apply(self, flush=False):
        rng, eng, K = self.rng, self.eng, self.knobs
        step, so, entries = eng.in_flight[0]
        a = {}
        if rng.random() < 0.2:
            a["step"] = step
        sampled = {}
        for rid, samples, pos in entries:
            if not samples:
                continue
            x = rng.random()
            if rid in self.stops and x < 0.25:
                sampled[rid] = [self.stops[rid]]
            elif x < 0.03:
                sampled[rid] = []
            elif x < 0.05:
                sampled[rid] = [rng.randint(1, 999)]
        if sampled:
            a["sampled"] = sampled
        # connector output
        p_recv = 1.0 if flush else K["p_recv"]
        p_send = 1.0 if flush else K["p_send"]
        recv_c = sorted(r for r, s in self.recv_pending.items() if s <= step and r in eng.s.requests)
        send_c = sorted(r for r in self.send_held if r in eng.s.requests and eng.s.requests[r].is_finished())
        fr = [r for r in recv_c if rng.random() < p_recv]
        fs = [r for r in send_c if rng.random() < p_send]
        # vLLM frees the requests of one completion set in hash order (which orders the free queue):
        # at most one completion per output that frees blocks (a send, or a receive of a request
        # that finished while loading); receives of requests still loading only mark them
        if len(fr) > 1 and rng.random() < 0.6 and not flush:
            fr = [rng.choice(fr)]
        freeing = [("s", r) for r in fs] + [("r", r) for r in fr if eng.s.requests[r].is_finished()]
        if len(freeing) > 1:
            keep = rng.choice(freeing)
            fs = [r for r in fs if ("s", r) == keep]
            fr = [r for r in fr if ("r", r) == keep or not eng.s.requests[r].is_finished()]
        failed = []
        if not flush and recv_c and rng.random() < K["p_failed_recving"] * 3:
            failed = [rng.choice(recv_c)]
            if rng.random() < 0.5 and failed[0] not in fr and not eng.s.requests[failed[0]].is_finished():
                fr.append(failed[0])
        inv = []
        if not flush and self.ng == 1 and rng.random() < K["p_invalid"] * 3 and (not failed or rng.random() < 0.15):
            inv = self.pick_invalid(step, entries)
        if not flush and rng.random() < 0.02:
            # connector oddities vLLM tolerates in compat mode: a completion in the direction a
            # held request is not held for (frees it), a repeated receive for a load already
            # reported (ignored while it still loads), an unknown id in failed_recving (ignored)
            x = rng.random()
            held_recv = [r for r in recv_c if eng.s.requests[r].is_finished()]
            reported = [r for r in self.recv_reported if r in eng.s.requests
                        and self.status(r) == "waiting_for_remote_kvs" and r not in fr]
            if x < 0.35 and held_recv and not fs and not any(eng.s.requests[r].is_finished() for r in fr):
                fs = [rng.choice(held_recv)]
                self.ev("odd_send_for_recv_hold")
            elif x < 0.6 and send_c and not fs and not any(eng.s.requests[r].is_finished() for r in fr):
                fr = sorted(set(fr) | {rng.choice(send_c)})
                self.ev("odd_recv_for_send_hold")
            elif x < 0.85 and reported:
                fr = sorted(set(fr) | {rng.choice(reported)})
                self.ev("odd_repeated_recv")
            elif rng.random() < 0.25:
                failed = failed + [self.ghost()]
                self.ev("odd_failed_unknown")
        if rng.random() < 0.003 and not flush:
            # a completion vLLM does not expect (sticky completion_for_live_request or stale)
            live_running = [r for r in self.live() if self.status(r) == "running"]
            if live_running:
                fr = sorted(set(fr) | {rng.choice(live_running)})
                self.ev("bad_completion")
        if fr:
            a["finished_recving"] = sorted(set(fr))
        elif rng.random() < 0.05:
            a["finished_recving"] = []
        if fs:
            a["finished_sending"] = sorted(set(fs))
        if failed:
            a["failed_recving"] = failed
        if inv:
            a["invalid_block_ids"] = inv
        if not any(k in a for k in ("finished_recving", "finished_sending", "failed_recving", "invalid_block_ids")) \
                and rng.random() < 0.05:
            a["no_kv_output"] = True
        self.do("apply_output", a)

    def pick_invalid(self, step, entries):
        rng, eng = self.rng, self.eng
        cands = []
        for s, ld in self.loads:
            if s > step or ld["id"] not in eng.s.requests:
                continue
            r = eng.s.requests[ld["id"]]
            if r.is_finished():
                continue
            if ld["async"] and ld["id"] in self.recv_pending:
                cands.append(ld)
            elif not ld["async"] and s == step:
                cands.append(ld)
        x = rng.random()
        if cands and x < 0.85:
            ld = rng.choice(cands)
            bl = ld["blocks"][0]
            lk = self.last_lookup.get(ld["id"])
            lo = (lk["num_computed_tokens"] // self.bs) if lk else 0
            hi = len(bl)
            if lo >= hi:
                lo = 0
            picks = {bl[rng.randint(lo, hi - 1)] for _ in range(rng.choice([1, 1, 1, 2]))}
            self.ev("invalid_from_load")
            return sorted(picks)
        if x < 0.88 and (not cands or rng.random() < 0.3):
            return []
        if x < 0.95:
            running = [rid for rid in self.live() if self.status(rid) == "running"]
            if running:
                rid = rng.choice(running)
                bl = eng.s.kv_cache_manager.get_block_ids(rid)[0]
                if bl:
                    self.ev("invalid_from_running")
                    return [rng.choice(list(bl))]
            return []
        self.ev("invalid_random")
        return [rng.randint(1, self.nblocks - 1)]

    def c_abort(self):
        self.do("abort", {"id": self.rng.choice(sorted(self.live()))})

    def c_abort_held(self):
        self.do("abort", {"id": self.rng.choice(sorted(self.send_held))})

    def c_abort_dead(self):
        dead = [x for x in self.inc if x not in self.live()]
        rid = self.rng.choice(sorted(dead)) if dead and self.rng.random() < 0.7 else self.ghost()
        self.do("abort", {"id": rid})

    def ghost(self):
        # An id never added. Name it first in a query both runners intern the same way.
        return "ghost"

    def c_resolve(self):
        rid = self.rng.choice(sorted(self.asked_pending))
        r = self.R(rid)
        if r is None:
            self.asked_pending.discard(rid)
            return
        ub = self.hit_ub(rid, r)
        lk = self.choose_lookup(rid, r.num_tokens, ub, allow_pending=self.rng.random() < 0.1)
        self.do("set_lookup", {"id": rid, "lookup": lk})

    def c_set_lookup(self):
        rng = self.rng
        cand = [rid for rid in self.live() if self.R(rid).num_computed_tokens == 0
                and self.status(rid) in ("waiting", "preempted")]
        if not cand:
            if self.inc and rng.random() < 0.3:
                self.do("set_lookup", {"id": rng.choice(sorted(self.inc)), "lookup": {"tokens": 0}})
            return
        rid = rng.choice(sorted(cand))
        r = self.R(rid)
        lk = self.choose_lookup(rid, r.num_tokens, self.hit_ub(rid, r))
        self.do("set_lookup", {"id": rid, "lookup": lk})
        if lk is None:
            self.pending_set.add(rid)

    def c_set_misc(self):
        rng = self.rng
        ids = sorted(self.inc)
        x = rng.random()
        if x < 0.3 and ids:
            self.do("set_delay_free", {"id": rng.choice(ids), "delay": rng.random() < 0.6})
        elif x < 0.45:
            self.do("set_delay_all", {"value": not self.eng.connector.delay_all if rng.random() < 0.8 else False})
        elif x < 0.75 and ids:
            p = {k: rng.choice(["a", "b", "host1", "42"]) for k in rng.sample(["remote", "port", "engine"], rng.randint(1, 2))}
            self.do("set_finish_params", {"id": rng.choice(ids), "params": p})
        elif x < 0.88:
            self.do("set_pending_block_frees", {"value": not self.eng.connector.pending_frees})
        else:
            self.do("set_push_work", {"value": not self.eng.connector.push_work})

    def c_state(self):
        self.do("state")

    def c_request(self):
        ids = sorted(self.inc)
        rid = self.rng.choice(ids) if ids and self.rng.random() < 0.95 else self.ghost()
        self.do("request", {"id": rid})

    def c_connector_calls(self):
        self.do("connector_calls")

    def quiesce(self):
        """Flush the pipeline and step until vLLM holds nothing (or a step cap), reporting every
        pending completion; then look around."""
        rng, eng = self.rng, self.eng
        self.ev("quiesce_attempt")
        if eng.connector.push_work and rng.random() < 0.9:
            self.do("set_push_work", {"value": False})
        if not self.done and eng.connector.pending_frees and rng.random() < 0.9:
            self.do("set_pending_block_frees", {"value": False})
        for rid in sorted(self.asked_pending | self.pending_set):
            if self.done:
                return
            r = self.R(rid)
            if r is not None and not r.is_finished():
                self.do("set_lookup", {"id": rid, "lookup": {"tokens": 0}})
        for _ in range(80):
            if self.done:
                return
            st = self.eng.s.has_requests() or eng.in_flight
            if not st:
                break
            if eng.in_flight and (len(eng.in_flight) >= self.depth or rng.random() < 0.5):
                self.c_apply(flush=True)
            else:
                self.c_schedule()
        if self.done:
            return
        self.do("state")
        if not self.done and not eng.s.has_requests():
            self.ev("quiesced")
        if not self.done and rng.random() < 0.5:
            self.do("connector_calls")

    # -- typed errors (valid input, documented error kinds) ------------------------------------
    def typed_error(self):
        rng, eng = self.rng, self.eng
        inf = eng.in_flight
        ch = []
        if inf:
            ch.append(lambda: self.do("apply_output", {"step": inf[-1][0] + rng.randint(1, 2)}))   # step_out_of_order
            sched = {e[0] for e in inf[0][2]}
            others = [x for x in sorted(self.inc) if x not in sched]
            if others:
                ch.append(lambda: self.do("apply_output", {"sampled": {rng.choice(others): [7]}}))  # not_scheduled
        else:
            ch.append(lambda: self.do("apply_output"))                                            # step_out_of_order
        if len(inf) >= self.depth:
            ch.append(lambda: self.do("schedule"))                                                # pipeline_full
        if eng.s.requests:
            ch.append(lambda: self.do("add_request", {"id": rng.choice(sorted(eng.s.requests)),
                                                      "prompt": self.toks(5), "max_tokens": 2}))  # duplicate_request
        ch.append(lambda: self.do("add_request", {"id": self.fresh_id(), "prompt": self.toks(3), "max_tokens": 0}))
        ch.append(lambda: self.do("add_request", {"id": self.fresh_id(), "prompt_len": self.max_model_len,
                                                  "max_tokens": 1}))                              # bad_request
        if inf:
            ch.append(lambda: self.do("apply_output", {"finished_recving": [self.ghost()]}))     # unknown_request
            ch.append(lambda: self.do("apply_output", {"finished_sending": [self.ghost()]}))     # unknown_request
            if self.ng > 1:
                ch.append(lambda: self.do("apply_output", {"invalid_block_ids": [1]}))           # invalid_blocks_with_multiple_groups
            ch.append(lambda: self.do("apply_output", {"invalid_block_ids": [self.nblocks + rng.randint(0, 3)]}))  # block_out_of_range
        rng.choice(ch)()


def gen_case(seed, idx, mix="all"):
    g = Gen(seed, idx, mix)
    case = g.build()
    return case, g


def case_file(seed, idx):
    return "case-%d-%d.json" % (seed, idx)


def write_case(path, case):
    oracle().write_case(path, case)


def worker_gen(seed, start, end, outdir, mix):
    """Worker: generates cases [start, end), one JSON line of info per case on stdout."""
    adir = outdir.rstrip("/") + "-asserts"
    for i in range(start, end):
        t0 = time.time()
        case, g = gen_case(seed, i, mix)
        info = {"idx": i, "profile": g.prof, "events": g.events, "errors": dict(g.errors), "secs": time.time() - t0,
                "ngroups": g.ng, "depth": g.depth, "swa": g.swa}
        if g.assert_info is not None:
            os.makedirs(adir, exist_ok=True)
            write_case(os.path.join(adir, case_file(seed, i)), case)
            case["calls"] = case["calls"][:g.assert_info["index"]]
            info["assert"] = g.assert_info
        info["ncalls"] = len(case["calls"])
        write_case(os.path.join(outdir, case_file(seed, i)), case)
        print(json.dumps(info), flush=True)


def run_oracle(case):
    O = oracle()
    O.L.STUB_CALLS.clear()
    eng = O.Engine(jcopy(case.get("config") or {}))
    return [call_engine(eng, c["call"], c.get("args") or {}) for c in case["calls"]]


def first_diff(case):
    """Index of the first call whose oracle result differs from the case's expectation, or None."""
    O = oracle()
    try:
        res = run_oracle(case)
    except O.CaseErr:
        return 0
    for i, (c, got) in enumerate(zip(case["calls"], res)):
        if "expect_error" in c:
            exp = ["error", c["expect_error"]]
        elif "expect" in c:
            exp = ["value", O.normalize_expected(c["call"], c["expect"])]
        else:
            if got[0] == "error":
                return i
            continue
        if exp != list(got):
            return i
    return None


class _OrderedIterSet(set):
    """A set that iterates in a fixed order (ascending or descending)."""
    desc = False

    def __iter__(self):
        return iter(sorted(set.__iter__(self), reverse=self.desc))


def force_set_order(desc):
    """Make vLLM's order-sensitive set iterations deterministic in this process: the completion
    sets of a KVConnectorOutput (freed in iteration order) and finish_requests over several ids
    (finished and freed in iteration order). Finishing the ids one by one in the chosen order is
    what finish_requests does for a set iterated in that order (its first pass only removes them
    from the queues)."""
    O = oracle()
    _OrderedIterSet.desc = desc
    orig_out = O.OUTS.KVConnectorOutput

    def make_output(**kw):
        for k in ("finished_sending", "finished_recving"):
            if isinstance(kw.get(k), set):
                kw[k] = _OrderedIterSet(kw[k])
        return orig_out(**kw)
    O.OUTS.KVConnectorOutput = make_output
    cls = O.SCHED.Scheduler
    orig_fin = cls.finish_requests

    def finish_requests(self, request_ids, finished_status):
        if request_ids is None or isinstance(request_ids, str):
            return orig_fin(self, request_ids, finished_status)
        out = []
        for rid in sorted(set(request_ids), reverse=desc):
            out += orig_fin(self, rid, finished_status)
        return out
    cls.finish_requests = finish_requests


def worker_check(files):
    """Worker: first differing call of every case under this process's hash seed; with
    `_check_asc`/`_check_desc`, with the order-sensitive set iterations forced (force_set_order)."""
    for f in files:
        case = json.load(open(f))
        print(json.dumps({"file": f, "diff": first_diff(case)}), flush=True)


# =============================================================================================
# Orchestration (no oracle import)

def spawn(args, hashseed):
    env = dict(os.environ, PYTHONHASHSEED=str(hashseed))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, env=env,
                            stdout=subprocess.PIPE, text=True)


def run_parallel(jobs, on_line):
    """jobs: list of (args, hashseed); runs them all at once, calling on_line(json) per stdout line."""
    procs = [spawn(a, h) for a, h in jobs]
    lock = threading.Lock()

    def pump(p):
        for line in p.stdout:
            line = line.strip()
            if line.startswith("{"):
                with lock:
                    on_line(json.loads(line))
    ts = [threading.Thread(target=pump, args=(p,)) for p in procs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rcs = [p.wait() for p in procs]
    if any(rcs):
        sys.exit("a worker failed (exit %s)" % rcs)


def splits(n, k):
    k = max(1, min(k, n))
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def count_schedules(calls):
    return sum(1 for c in calls if c["call"] == "schedule")


def generate(n, outdir, seed, jobs, hash_seeds, mix="all", replay_same=True):
    os.makedirs(outdir, exist_ok=True)
    for f in os.listdir(outdir):
        if f.startswith("case-") and f.endswith(".json"):
            os.remove(os.path.join(outdir, f))
    adir = outdir.rstrip("/") + "-asserts"
    if os.path.isdir(adir):
        for f in os.listdir(adir):
            os.remove(os.path.join(adir, f))
    t0 = time.time()
    infos = {}
    last = [0]

    def on_gen(d):
        infos[d["idx"]] = d
        if len(infos) - last[0] >= 500:
            last[0] = len(infos)
            print("  generated %d/%d (%.1f cases/s)" % (len(infos), n, len(infos) / (time.time() - t0)), flush=True)
    run_parallel([(["_gen", str(seed), str(a), str(b), outdir, mix], GEN_HASHSEED) for a, b in splits(n, jobs)], on_gen)
    tgen = time.time() - t0
    print("generated %d cases in %.1fs (%.1f cases/s)" % (n, tgen, n / max(tgen, 1e-9)), flush=True)

    # hash-seed dependence: re-run under other seeds, truncate before the first differing call
    files = [os.path.join(outdir, case_file(seed, i)) for i in range(n)]
    t1 = time.time()
    seeds = [("_check", hs) for hs in hash_seeds]
    if replay_same:
        seeds.append(("_check", int(GEN_HASHSEED)))
    seeds += [("_check_asc", int(GEN_HASHSEED)), ("_check_desc", int(GEN_HASHSEED))]
    diffs = collections.defaultdict(dict)   # file -> {(mode, hashseed): idx}
    for mode, hs in seeds:
        def on_chk(d, key=(mode, hs)):
            if d["diff"] is not None:
                diffs[d["file"]][key] = d["diff"]
        run_parallel([([mode] + files[a:b], hs) for a, b in splits(len(files), jobs)], on_chk)
    trunc = {"cases_truncated": 0, "calls_cut": 0, "same_seed_replay_mismatch": [], "by_call": collections.Counter(),
             "by_check": collections.Counter(), "dropped": 0}
    cut_at = {}
    for f, d in sorted(diffs.items()):
        for key in d:
            trunc["by_check"][key[0][7:] or "hashseed"] += 1
        if ("_check", int(GEN_HASHSEED)) in d:
            trunc["same_seed_replay_mismatch"].append(os.path.basename(f))
        cut = min(d.values())
        case = json.load(open(f))
        trunc["cases_truncated"] += 1
        trunc["calls_cut"] += len(case["calls"]) - cut
        trunc["by_call"][case["calls"][cut]["call"]] += 1
        case["calls"] = case["calls"][:cut]
        idx = int(os.path.basename(f)[:-5].split("-")[-1])
        cut_at[idx] = cut
        if count_schedules(case["calls"]) < MIN_SCHEDULES:
            os.remove(f)
            trunc["dropped"] += 1
            cut_at[idx] = -1
            continue
        case["name"] += " (truncated at call %d: hash-seed dependent)" % cut
        write_case(f, case)
    tchk = time.time() - t1
    print("hash-seed check (%s) in %.1fs: %d cases truncated, %d dropped" % (
        seeds, tchk, trunc["cases_truncated"], trunc["dropped"]), flush=True)

    mix_d = summarize_mix(infos, trunc, cut_at, n, tgen, tchk)
    json.dump(mix_d, open(os.path.join(outdir, "MIX.json"), "w"), indent=1, sort_keys=True)
    print_mix(mix_d)
    return mix_d


TARGETS = [  # (feature, description, goal share of cases)
    ("preemption", "at least one preemption", 0.15),
    ("two_groups_hit_and_load", "two groups, local hit + load in one admission", 0.10),
    ("depth2_load_failure", "async depth 2 with a load failure reported", 0.10),
    ("swa_hit_and_external", "sliding window, local hit + external tokens", 0.05),
]


def summarize_mix(infos, trunc, cut_at, n, tgen, tchk):
    tot = collections.Counter()
    cases_with = collections.Counter()
    errs = collections.Counter()
    profiles = collections.Counter()
    asserts = collections.Counter()
    assert_examples = {}
    kept = 0
    ncalls = 0
    for idx, d in infos.items():
        cut = cut_at.get(idx)
        if cut == -1:
            continue
        kept += 1
        profiles[d["profile"]] += 1
        per = collections.Counter()
        for (ci, k, v) in d["events"]:
            if cut is not None and ci >= cut and not k.startswith("profile:"):
                continue
            per[k] += v
        for k, v in per.items():
            tot[k] += v
            cases_with[k] += 1
            if k.startswith("error:"):
                errs[k[6:]] += v
        ncalls += d["ncalls"] if cut is None else cut
        if "assert" in d:
            a = d["assert"]
            key = a["kind"] + " on " + a["call"]
            asserts[key] += 1
            assert_examples.setdefault(key, "case-?-%d.json" % idx)
        for key in ("ngroups=%d" % d["ngroups"], "depth=%d" % d["depth"]) + (("swa",) if d["swa"] else ()):
            cases_with["cfg:" + key] += 1
    targets = {f: {"cases": cases_with.get(f, 0), "share": round(cases_with.get(f, 0) / max(kept, 1), 3),
                   "goal": g, "what": w} for f, w, g in TARGETS}
    return {"cases_generated": n, "cases_kept": kept, "calls": ncalls, "gen_seconds": round(tgen, 1),
            "check_seconds": round(tchk, 1), "profiles": dict(sorted(profiles.items())), "targets": targets,
            "totals": dict(sorted(tot.items())), "cases_with": dict(sorted(cases_with.items())),
            "typed_errors": dict(sorted(errs.items())),
            "internal_asserts": dict(asserts), "internal_assert_example_files": assert_examples,
            "hash_seed": {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in trunc.items()}}


def print_mix(m):
    t, c = m["totals"], m["cases_with"]
    kept = m["cases_kept"]
    print("case mix (%d cases kept of %d, %d calls):" % (kept, m["cases_generated"], m["calls"]))
    print("  profiles: " + ", ".join("%s %d" % kv for kv in m["profiles"].items()))
    print("  configs: " + ", ".join("%s %d" % (k[4:], v) for k, v in c.items() if k.startswith("cfg:")))
    print("  targets (cases where it actually happened):")
    for f, d in m["targets"].items():
        print("    %-26s %5d  %5.1f%%  (goal %.0f%%) %s" % (f, d["cases"], 100 * d["share"], 100 * d["goal"],
                                                           "" if d["share"] >= d["goal"] else "BELOW GOAL"))
    ev = ["steps", "preemption", "resumed", "async_load", "sync_load", "local_hit", "hit_and_load",
          "lookup_pending_asked", "pending_resolved", "lookup_fixed", "contract_break_kept",
          "finished_recving", "finished_sending", "failed_recving", "invalid_block_ids", "invalid_from_load",
          "invalid_from_running", "delayed_free", "kv_transfer_params_out", "no_kv_output", "sampled_override",
          "abort_waiting", "abort_running", "abort_waiting_for_remote_kvs", "abort_preempted", "abort_held",
          "abort_false", "finish_stopped", "finish_length_capped", "finish_aborted", "finish_error",
          "quiesce_attempt", "quiesced", "id_reuse", "bad_completion", "odd_send_for_recv_hold",
          "odd_recv_for_send_hold", "odd_repeated_recv", "odd_failed_unknown", "cut_multi_error",
          "call:set_delay_free", "call:set_delay_all", "call:set_finish_params", "call:set_pending_block_frees",
          "call:set_push_work", "call:set_lookup", "call:request", "call:state", "call:connector_calls"]
    print("  events (total / cases with it):")
    for i in range(0, len(ev), 4):
        print("    " + "; ".join("%s %d/%d" % (k, t.get(k, 0), c.get(k, 0)) for k in ev[i:i + 4]))
    print("  typed errors: " + ", ".join("%s %d" % kv for kv in m["typed_errors"].items()))
    sticky = {k[7:]: v for k, v in c.items() if k.startswith("sticky:")}
    print("  sticky errors ending a case (cases): %s" % (sticky or "none"))
    print("  internal asserts (call cut from the case): %s" % (m["internal_asserts"] or "none"))
    h = m["hash_seed"]
    print("  hash-seed truncations: %d cases, %d calls cut, first differing call: %s; detected by: %s; "
          "dropped (< %d schedules) %d; same-seed replay mismatches: %s" % (
              h["cases_truncated"], h["calls_cut"], h["by_call"], h["by_check"], MIN_SCHEDULES,
              h["dropped"], h["same_seed_replay_mismatch"] or "none"))


FAIL_RE = re.compile(r"^FAIL (.*?): call (\d+) \(([a-z_]+)\): (.*)$")


def run_kvrelay(kvrelay, path):
    """`kvrelay conformance` on a case file, or on the generated cases of a folder (DIR/MIX.json is
    not a case, so the folder itself is not passed)."""
    if os.path.isdir(path):
        paths = sorted(os.path.join(path, f) for f in os.listdir(path) if f.startswith("case-") and f.endswith(".json"))
    else:
        paths = [path]
    out = []
    for i in range(0, len(paths), 2000):
        p = subprocess.run([kvrelay, "conformance"] + paths[i:i + 2000], capture_output=True, text=True)
        out.append(p.stdout + p.stderr)
    return "\n".join(out)


def cmd_run(a):
    if not os.path.exists(a.kvrelay):
        sys.exit("kvrelay binary %s missing: cargo build --release -p kvrelay-cli" % a.kvrelay)
    generate(a.n, a.dir, a.seed, a.jobs, a.hash_seeds, a.mix)
    t0 = time.time()
    out = run_kvrelay(a.kvrelay, a.dir)
    tk = time.time() - t0
    passed = failed = 0
    groups = collections.defaultdict(list)
    for line in out.splitlines():
        if line.startswith("PASS "):
            passed += 1
        elif line.startswith("FAIL "):
            failed += 1
            m = FAIL_RE.match(line)
            groups[m.group(3) if m else "(no call)"].append(line)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    print("kvrelay replay: %d cases in %.1fs (%.0f cases/s): %s" % (passed + failed, tk, (passed + failed) / max(tk, 1e-9), last))
    print("cases %d, passed %d, failed %d" % (passed + failed, passed, failed))
    for k, lst in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print("  first differing call %-16s %d" % (k, len(lst)))
        for line in lst[:3]:
            print("    " + (line if len(line) < 400 else line[:400] + " ..."))
    open(os.path.join(a.dir, "KVRELAY.txt"), "w").write(out)
    return 1 if failed else 0


def cmd_replay(a):
    if os.environ.get("PYTHONHASHSEED") != GEN_HASHSEED:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED=GEN_HASHSEED))
    files = []
    for p in a.cases:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".json") and f != "MIX.json")
        else:
            files.append(p)
    bad = 0
    for f in files:
        case = json.load(open(f))
        if case.get("machine") != "engine" or (case.get("config") or {}).get("connector", "scripted") != "scripted":
            print("SKIP " + f)
            continue
        d = first_diff(case)
        if d is not None and (case.get("config") or {}).get("mode") == "strict":
            print("NOTE %s: strict mode is kvrelay's extension; vLLM (compat) differs at call %d" % (f, d))
            continue
        if d is None:
            print("OK   " + f)
        else:
            bad += 1
            res = run_oracle(case)
            c = case["calls"][d]
            print("BAD  %s: call %d (%s): case says %s, vLLM gives %s" % (
                f, d, c["call"], json.dumps(c.get("expect", c.get("expect_error")))[:300], json.dumps(res[d])[:300]))
    print("%d bad" % bad)
    return 1 if bad else 0


# -- shrinking ---------------------------------------------------------------------------------

def refill(case):
    res = run_oracle(case)
    calls = []
    for c, got in zip(case["calls"], res):
        c = {k: v for k, v in c.items() if k not in ("expect", "expect_error")}
        if got[0] == "error":
            c["expect_error"] = got[1]
        else:
            c["expect"] = got[1]
        calls.append(c)
        if got[0] == "error" and is_sticky(got[1]):
            break
    return dict(case, calls=calls)


def kv_fail(kvrelay, case, tmpdir):
    p = os.path.join(tmpdir, "c.json")
    write_case(p, case)
    for line in run_kvrelay(kvrelay, p).splitlines():
        m = FAIL_RE.match(line)
        if m:
            return m.group(3), int(m.group(2)), m.group(4)
        if line.startswith("FAIL "):
            return "(no call)", -1, line
    return None


def drop_request(calls, rid):
    out = []
    for c in calls:
        a = c.get("args") or {}
        if a.get("id") == rid:
            continue
        c = dict(c)
        if a:
            a = dict(a)
            for k in ("finished_recving", "finished_sending", "failed_recving"):
                if isinstance(a.get(k), list) and rid in a[k]:
                    a[k] = [x for x in a[k] if x != rid]
                    if not a[k] and k == "failed_recving":
                        del a[k]
            if isinstance(a.get("sampled"), dict) and rid in a["sampled"]:
                a["sampled"] = {k: v for k, v in a["sampled"].items() if k != rid}
                if not a["sampled"]:
                    del a["sampled"]
            c["args"] = a
            if not a:
                del c["args"]
        out.append(c)
    return out


def cmd_shrink(a):
    if os.environ.get("PYTHONHASHSEED") != GEN_HASHSEED:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED=GEN_HASHSEED))
    case = json.load(open(a.case))
    tmp = tempfile.mkdtemp(prefix="edshrink")
    f0 = kv_fail(a.kvrelay, case, tmp)
    if f0 is None:
        sys.exit("the case passes kvrelay")
    sig = f0[0]
    print("failure: call %d (%s): %s" % (f0[1], f0[0], f0[2][:300]))

    def test(cs):
        try:
            c = refill(dict(case, calls=cs))
        except Exception:
            return None
        r = kv_fail(a.kvrelay, c, tmp)
        if r is None or r[0] != sig:
            return None
        c["calls"] = c["calls"][:r[1] + 1]
        return c

    best = test(case["calls"][:f0[1] + 1]) or case
    calls = best["calls"]
    # 1. drop whole requests
    changed = True
    while changed:
        changed = False
        ids = []
        for c in calls:
            if c["call"] == "add_request" and c["args"]["id"] not in ids:
                ids.append(c["args"]["id"])
        for rid in ids:
            r = test(drop_request(calls, rid))
            if r is not None:
                best, calls, changed = r, r["calls"], True
                break
    # 2. ddmin over calls
    n = 2
    while len(calls) >= 2:
        chunk = max(1, len(calls) // n)
        reduced = False
        for s in range(0, len(calls), chunk):
            cand = calls[:s] + calls[s + chunk:]
            if not cand:
                continue
            r = test(cand)
            if r is not None:
                best, calls = r, r["calls"]
                n = max(n - 1, 2)
                reduced = True
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(calls), n * 2)
    # 3. drop optional arguments of calls
    for i in range(len(calls)):
        for k in ("sampled", "step", "stop_token", "delay_free", "finished_recving", "finished_sending"):
            a_ = (calls[i].get("args") or {})
            if k in a_:
                cand = [dict(c) for c in calls]
                cand[i]["args"] = {kk: vv for kk, vv in a_.items() if kk != k}
                r = test(cand)
                if r is not None:
                    best, calls = r, r["calls"]
    best = refill(dict(case, calls=calls))
    r = kv_fail(a.kvrelay, best, tmp)
    best["name"] = case["name"] + " (shrunk)"
    out = a.out or a.case.replace(".json", "") + "-shrunk.json"
    write_case(out, best)
    print("shrunk to %d calls -> %s\n  call %d (%s): %s" % (len(best["calls"]), out, r[1], r[0], r[2][:800]))


def cmd_regen(a):
    if os.environ.get("PYTHONHASHSEED") != GEN_HASHSEED:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED=GEN_HASHSEED))
    os.makedirs(a.dir, exist_ok=True)
    worker_gen(a.seed, a.index, a.index + 1, a.dir, a.mix)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_gen":
        seed, start, end, outdir, mix = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
        return worker_gen(seed, start, end, outdir, mix)
    if len(sys.argv) > 1 and sys.argv[1] in ("_check", "_check_asc", "_check_desc"):
        if sys.argv[1] != "_check":
            force_set_order(sys.argv[1] == "_check_desc")
        return worker_check(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
        p.add_argument("--mix", default="all", choices=["all"] + list(PROFILES),
                       help="profile mix: `all` (weighted, default) or one profile")
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPUs)")
        p.add_argument("--min-window", type=int, default=1,
                       help="smallest sliding window generated (default 1; 2 leaves out windows of one token)")
        p.add_argument("--hash-seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3],
                       help="PYTHONHASHSEED values to re-check every case under (default 1,2,3)")
    g = sub.add_parser("generate", help="generate N cases with vLLM's results into DIR (+ DIR/MIX.json)")
    g.add_argument("n", type=int)
    g.add_argument("dir")
    common(g)
    r = sub.add_parser("run", help="generate, run `kvrelay conformance` on them, summarise; exit 1 on failures")
    r.add_argument("n", type=int)
    r.add_argument("dir")
    common(r)
    r.add_argument("--kvrelay", default=DEFAULT_KVRELAY, help="kvrelay binary (default target/release/kvrelay)")
    rp = sub.add_parser("replay", help="check existing cases against the oracle (OK/BAD per case)")
    rp.add_argument("cases", nargs="+")
    s = sub.add_parser("shrink", help="delta-debug a failing case (the oracle re-fills the expectations)")
    s.add_argument("case")
    s.add_argument("--out")
    s.add_argument("--kvrelay", default=DEFAULT_KVRELAY)
    rg = sub.add_parser("regen", help="regenerate case INDEX of seed SEED into DIR")
    rg.add_argument("seed", type=int)
    rg.add_argument("index", type=int)
    rg.add_argument("dir")
    rg.add_argument("--mix", default="all", choices=["all"] + list(PROFILES))
    rg.add_argument("--min-window", type=int, default=1)
    a = ap.parse_args()
    if getattr(a, "min_window", None):
        os.environ["ENGINE_DIFF_MIN_WINDOW"] = str(a.min_window)
    if a.cmd == "generate":
        generate(a.n, a.dir, a.seed, a.jobs, a.hash_seeds, a.mix)
        return 0
    if a.cmd == "run":
        return cmd_run(a)
    if a.cmd == "replay":
        return cmd_replay(a)
    if a.cmd == "shrink":
        return cmd_shrink(a)
    if a.cmd == "regen":
        return cmd_regen(a)


if __name__ == "__main__":
    sys.exit(main())
