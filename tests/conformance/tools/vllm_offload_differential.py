#!/usr/bin/env python3
"""Differential testing of kvrelay's `engine` machine with the OFFLOADING connector against vLLM 0.33.0.

Random conformance cases (FORMAT.md, machine `engine`, `"connector": {"offloading": {...}}`) are built
call by call while driving a LIVE oracle engine (vllm_offload_ref.OffloadEngine: vLLM's real scheduler,
real OffloadingConnector on both sides, real CPU manager with LRU/ARC, real aggregator; only the DMA is
simulated). Each call is chosen from the oracle's current state (execute only with an unexecuted step,
complete only with transfers awaiting completion on that rank, ...) and its result is recorded as
`expect` / `expect_error`, exactly as `vllm_offload_ref.py --fill` writes it. kvrelay then replays
the cases with `kvrelay conformance DIR`.

Commands
  generate N DIR [--seed S]   write N cases (compat mode) with vLLM's results as expectations into DIR,
                              plus DIR/MIX.json (what the cases exercised). Use it to build a corpus
                              to inspect or to run later (`kvrelay conformance DIR`).
  run N DIR [--seed S] [--kvrelay PATH]
                              generate, then run kvrelay on DIR and summarise (cases, passed, failed,
                              failures grouped by the first differing call). Exit status 1 on any
                              failure. This is the everyday command.
  shrink CASE [--out PATH]    delta-debug one failing case: drop calls while kvrelay still fails at
                              the same kind of call, re-filling the expectations with the oracle after
                              every change. Use it on a FAIL of `run` to get a small reproduction.
  regen SEED INDEX DIR        regenerate the single case INDEX of seed SEED (the case name carries
                              both) into DIR, without the hash-seed check.
  fill CASE...                rewrite the expectations of hand-written cases with vLLM's answers.
  check CASE...               OK / BAD per case against vLLM's answers (exit 1 on a BAD).

Cases are generated under PYTHONHASHSEED=0 (worker subprocesses), then re-run by the oracle under
other hash seeds (--hash-seeds, default 1,2,3,4; 0 is also replayed with --replay-same to catch state
leaking between cases of one process) and truncated before the first call whose result differs.
vLLM's scheduler iterates `finished_req_ids` (a Python set) where the offloading connector builds the
finished requests' last stores and calls on_request_finished, so LRU/ARC recency and chunk ids of two
requests finishing in one step depend on the hash seed; the oracle here iterates it in finish order,
kvrelay's documented order (--finished-order set: vLLM's own). --profile stress biases the mix toward
small host pools, aborts, held ranks and jobs completed by hand in any order. A call that makes vLLM
assert (sticky `internal_assert:<file>:<line>:<fn>`, which kvrelay has no kind for) is cut from the
case; the case up to and including it is saved to DIR-asserts/ for inspection. Other sticky errors
(completion_for_live_request, stale_completion, ...) end the case after the call.

Same --seed => same cases (the generator's RNG is seeded per case from (seed, index)).
The oracle lives in <repo>/../shared/tools/vllm-oracle (override: env VLLM_ORACLE).
"""
import argparse, collections, json, os, random, re, subprocess, sys, tempfile, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
ORACLE = os.environ.get("VLLM_ORACLE") or os.path.abspath(os.path.join(REPO, "..", "shared", "tools", "vllm-oracle"))
DEFAULT_KVRELAY = os.path.join(REPO, "target", "release", "kvrelay")
GEN_HASHSEED = "0"
# --avoid: input shapes of known failure classes the generator can leave out (env VLLM_OFFLOAD_DIFF_AVOID
# carries them to the worker processes)
AVOIDABLE = {"sampled_not_scheduled": "apply_output with `sampled` naming a request the step did not schedule",
             "swa_window1": "a sliding window of 1 token"}
AVOID = set(filter(None, os.environ.get("VLLM_OFFLOAD_DIFF_AVOID", "").split(",")))
# --profile: the mix of inputs (env VLLM_OFFLOAD_DIFF_PROFILE carries it to the worker processes)
PROFILES = {"default": "the everyday mix",
            "stress": "small host pools (1-6 chunks mostly), a small GPU pool more often, more aborts, "
                      "holds and jobs completed by hand, named in any order (out-of-order completions)"}
PROFILE = os.environ.get("VLLM_OFFLOAD_DIFF_PROFILE", "default")
STRESS = PROFILE == "stress"
# --finished-order: how the oracle's scheduler iterates `finished_req_ids` (env
# VLLM_OFFLOAD_DIFF_FINISHED_ORDER). vLLM's is a Python set, iterated in hash-seed order where the
# offloading connector builds finished requests' last stores and signals on_request_finished
# (offloading/scheduler.py:1821, :2177); kvrelay fixes finish order (FORMAT.md, *Where vLLM
# iterates a set*). `finish` (the default) runs vLLM's code with its set iterating in insertion
# order, which is finish order; `set` leaves vLLM's own (then the hash-seed re-check cuts cases
# where two requests finished in one step and the order mattered, and misses some).
FINISHED_ORDER = os.environ.get("VLLM_OFFLOAD_DIFF_FINISHED_ORDER", "finish")

STICKY = {"completion_for_live_request", "stale_completion", "duplicate_completion", "connector_contract",
          "intent_rejected", "internal_assert"}


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
            import vllm_offload_ref as O  # noqa
        import logging
        logging.disable(logging.CRITICAL)
        if FINISHED_ORDER == "finish":
            finished_in_finish_order(O.E.SCHED.Scheduler)
        _O = O
    return _O


class _InsertionOrderSet(set):
    """A set that iterates in insertion order (a Python set iterates in hash-seed order)."""

    def __init__(self, items=()):
        super().__init__()
        self._order = {}
        for x in items:
            self.add(x)

    def add(self, x):
        set.add(self, x)
        self._order[x] = None

    def discard(self, x):
        set.discard(self, x)
        self._order.pop(x, None)

    def remove(self, x):
        set.remove(self, x)
        del self._order[x]

    def update(self, *iterables):
        for it in iterables:
            for x in it:
                self.add(x)

    def clear(self):
        set.clear(self)
        self._order.clear()

    def __iter__(self):
        return iter(list(self._order))


def finished_in_finish_order(scheduler_cls):
    """vLLM's scheduler keeps `finished_req_ids` as a set it adds each request to as it frees it
    (`_free_request`, scheduler.py:3054) and hands to the connector as
    `SchedulerOutput.finished_req_ids` (:1738), then replaces by a fresh set (:1876). Every set
    assigned to the attribute becomes an insertion-ordered one, so the connector iterates the
    requests in the order they finished: kvrelay's documented order."""
    def get(self):
        return self.__dict__["_kvrelay_finished_req_ids"]

    def put(self, v):
        self.__dict__["_kvrelay_finished_req_ids"] = v if isinstance(v, _InsertionOrderSet) else _InsertionOrderSet(v)
    scheduler_cls.finished_req_ids = property(get, put)


def jcopy(v):
    return json.loads(json.dumps(v))


def call_one(eng, call, args):
    """One call on a live OffloadEngine: ("value", json) or ("error", kind). vLLM assertions are the
    oracle's sticky `internal_assert:<file>:<line>:<fn>`; any other exception raised inside vLLM's code
    (a KeyError, ...) is mapped the same way, as `internal_assert:exception:<type>:<file>:<line>:<fn>`."""
    O = oracle()
    fn = getattr(eng, call, None)
    if fn is None:
        return ("error", "unknown_call:" + call)
    try:
        return ("value", jcopy(fn(dict(args or {}))))
    except O.CaseErr as e:
        return ("error", e.kind)
    except Exception as e:
        import traceback
        tb = [f for f in traceback.extract_tb(e.__traceback__) if "vllm-ref" in f.filename] or \
            traceback.extract_tb(e.__traceback__)
        v = "internal_assert:exception:%s:%s:%d:%s" % (type(e).__name__, os.path.basename(tb[-1].filename),
                                                       tb[-1].lineno, tb[-1].name)
        eng.sticky = v
        return ("error", v)


def run_calls(case):
    """vllm_offload_ref.run_case with call_one's exception mapping."""
    O = oracle()
    O.L.STUB_CALLS.clear()
    eng = O.OffloadEngine(jcopy(case.get("config", {}) or {}))
    return [call_one(eng, c["call"], c.get("args")) for c in case["calls"]]


class Gen:
    """Builds one case against a live OffloadEngine."""

    def __init__(self, seed, idx):
        self.seed, self.idx = seed, idx
        self.rng = random.Random(seed * 1_000_003 + idx)
        self.O = oracle()
        self.calls = []
        self.stats = collections.Counter()
        self.errors = collections.Counter()
        self.done = False
        self.assert_info = None

    # -- config ------------------------------------------------------------------------------
    def gen_config(self):
        rng = self.rng
        W = rng.choices([1, 2, 3, 4], [50, 30, 10, 10])[0]
        nw = []
        if W > 1 and rng.random() < 0.35:
            nw = sorted(rng.sample(range(1, W), rng.randint(1, W - 1)))
        bs = 4 if rng.random() < 0.6 else rng.choice([1, 2, 3, 5, 8, 16])
        bpc = rng.randint(1, 4)
        r = rng.random()
        small, mid = (0.75, 0.95) if STRESS else (0.4, 0.75)
        cap = rng.randint(1, 6) if r < small else rng.randint(8, 24) if r < mid else rng.randint(48, 200)
        off = {"blocks_per_chunk": bpc, "capacity_chunks": cap}
        if rng.random() < 0.5:
            off["policy"] = "arc"
        elif rng.random() < 0.5:
            off["policy"] = "lru"
        thr = rng.choices([1, 2, 3], [60, 25, 15])[0]
        if thr != 1 or rng.random() < 0.2:
            off["store_threshold"] = thr
        if W > 1 or rng.random() < 0.2:
            off["ranks"] = W
        if nw:
            off["non_writers"] = nw
        if rng.random() < 0.4:
            off["sync_load_budget_tokens"] = rng.choice([bs, bs * bpc, 2 * bs * bpc, 32, 64, 10_000])
        if rng.random() < 0.5:
            off["offload_prompt_only"] = rng.random() < 0.5
        if rng.random() < 0.3:
            off["bytes_per_block"] = rng.choice([1, 2, 16, 4096])
        groups = ["full"]
        if rng.random() < 0.3:
            groups = ["full", {"sliding_window": rng.randint(2 if "swa_window1" in AVOID else 1, 32)}]
        cfg = {"block_size": bs, "connector": {"offloading": off}}
        if groups != ["full"]:
            cfg["groups"] = groups
        pc = rng.random() < 0.6
        if not pc:
            cfg["enable_prefix_caching"] = False
        depth = 1 if rng.random() < 0.65 else 2
        if depth > 1:
            cfg["async_depth"] = depth
        pressure = rng.random() < (0.6 if STRESS else 0.4)
        nblocks = rng.randint(6 + 2 * len(groups), 24) if pressure else rng.randint(32, 160)
        cfg["num_gpu_blocks"] = nblocks
        cfg["max_num_batched_tokens"] = rng.choice([8, 16, 32, 64, 128, 256])
        cfg["max_num_seqs"] = rng.choice([2, 3, 4, 8, 16])
        cfg["max_model_len"] = 512
        if rng.random() < 0.1:
            cfg["long_prefill_token_threshold"] = rng.choice([4, 8, 16])
        self.cfg = cfg
        self.W, self.bs, self.bpc, self.depth = W, bs, bpc, depth
        self.ngroups = len(groups)
        per_req_blocks = (nblocks - 1) // len(groups) - 1
        self.max_total = max(2, min(cfg["max_model_len"] - 1, per_req_blocks * bs))
        self.pressure = pressure
        st = self.stats
        st["W=%d" % W] += 1
        st["policy_" + off.get("policy", "lru")] += 1
        st["non_writers"] += bool(nw)
        st["swa"] += len(groups) > 1
        st["prefix_caching_off"] += not pc
        st["async_depth_2"] += depth > 1
        st["gpu_pressure"] += pressure
        st["sync_budget"] += bool(off.get("sync_load_budget_tokens"))
        st["store_threshold>1"] += thr > 1
        st["offload_all_tokens"] += off.get("offload_prompt_only") is False
        st["capacity_small(<=6)"] += cap <= 6
        st["bs=4"] += bs == 4
        return cfg

    # -- helpers -----------------------------------------------------------------------------
    def toks(self, n):
        return [self.rng.randint(1, 999) for _ in range(n)]

    def make_prompt(self, limit):
        rng = self.rng
        if self.prefixes and rng.random() < 0.75:
            p = rng.choice(self.prefixes)
            k = len(p) if rng.random() < 0.6 else rng.randint(1, len(p))
            extra = rng.choice([0, 0, 1, 2, self.bs, rng.randint(1, 40)])
            toks = p[:k] + self.toks(extra)
        else:
            toks = self.toks(rng.randint(1, 60))
        return toks[:max(1, limit)]

    def live(self):
        return [rid for rid, r in self.eng.s.requests.items() if not r.is_finished()]

    def pending_jobs(self, r):
        dma = self.eng.workers[r].connector_worker.worker
        return [t.job for t in dma.order if not t.done]

    def fresh_id(self):
        self.nid += 1
        return "r%d" % (self.nid - 1)

    # -- one call ----------------------------------------------------------------------------
    def do(self, call, args=None):
        c = {"call": call}
        if args:
            c["args"] = args
        pre = self.pre_call(call, args or {})
        r, v = call_one(self.eng, call, args)
        ok = r == "value"
        c["expect" if ok else "expect_error"] = v
        if not ok and v.startswith("internal_assert"):
            self.assert_info = {"call": call, "args": args, "kind": v, "index": len(self.calls)}
            self.calls.append(c)
            self.done = True
            return ok, v
        self.calls.append(c)
        self.post_call(call, args or {}, ok, v, pre)
        if not ok:
            self.errors[v] += 1
            if is_sticky(v):
                self.done = True
                self.stats["sticky:" + v] += 1
        return ok, v

    def pre_call(self, call, a):
        if call == "abort":
            r = self.eng.s.requests.get(a["id"])
            return r is not None and r.status == self.O.RequestStatus.WAITING_FOR_REMOTE_KVS
        if call == "reset_cache":
            return bool(self.eng.osched._jobs)
        return None

    def post_call(self, call, a, ok, v, pre):
        st = self.stats
        st["call:" + call] += 1
        if not ok:
            return
        if call == "schedule":
            self.count_sched(v)
        elif call == "execute":
            self.count_exec(v)
        elif call == "apply_output":
            self.count_apply(v)
        elif call == "run_step":
            self.count_sched(v["scheduled"])
            self.count_exec(v["executed"])
            self.count_apply(v["applied"])
        elif call == "abort":
            if v and pre:
                st["abort_while_loading"] += 1
            if v:
                st["aborts_true"] += 1
        elif call == "reset_cache":
            st["reset_true" if v else "reset_false"] += 1
            if pre:
                st["reset_with_jobs_in_flight"] += 1
        elif call == "lookup":
            flat = [x for g in v for x in g]
            st["lookup_hit"] += flat.count("hit")
            st["lookup_hit_pending"] += flat.count("hit_pending")
        elif call == "complete":
            st["completed_jobs_by_hand"] += len(v)
        elif call == "drain":
            st["drain_steps"] += v

    def count_sched(self, s):
        st = self.stats
        st["steps"] += 1
        if len(s["finished_req_ids"]) > 1:
            st["finished_together"] += 1
        st["preemptions"] += len(s["preempted_req_ids"])
        st["resumed"] += len(s["resumed"])
        m = s["meta"]
        st["load_jobs"] += len(m["load_jobs"])
        st["sync_load_jobs"] += sum(1 for j in m["load_jobs"].values() if j["sync"])
        st["store_jobs"] += len(m["store_jobs"])
        st["jobs_to_flush"] += len(m["jobs_to_flush"])
        for j in m["load_jobs"].values():
            self.loading.add(j["request"])

    def count_exec(self, e):
        st = self.stats
        for r in e["ranks"]:
            st["flushed_transfers"] += len(r["flushed"])
            st["sync_waited"] += len(r["sync_waited"])
            st["transfers_stored"] += len(r["stored"])
            st["transfers_loaded"] += len(r["loaded"])

    def count_apply(self, a):
        st = self.stats
        for ev in a["events"]:
            st["ev_removed" if ev.startswith("BlockRemoved") else "ev_stored"] += 1
        for o in a["outputs"]:
            if o["finish"]:
                st["finish_" + o["finish"]] += 1

    # -- the case ----------------------------------------------------------------------------
    def build(self):
        rng = self.rng
        cfg = self.gen_config()
        self.eng = self.O.OffloadEngine(jcopy(cfg))
        self.nid = 0
        self.loading = set()
        self.prefixes = [self.toks(rng.randint(2, 80)) for _ in range(rng.randint(1, 3))]
        self.stops = {}
        self.named_nobody = False
        max_reqs = rng.randint(1, 8)
        n_calls = rng.randint(10, 90)
        self.added = 0
        err_rate = 0.04
        while not self.done and len(self.calls) < n_calls:
            if rng.random() < err_rate:
                self.typed_error()
                continue
            self.step_choice(max_reqs)
        if not self.done and rng.random() < 0.7:
            self.finish()
        self.stats["calls"] += len(self.calls)
        name = "offload-diff seed %d #%d: W=%d %s cap=%d bpc=%d bs=%d%s%s" % (
            self.seed, self.idx, self.W, cfg["connector"]["offloading"].get("policy", "lru"),
            cfg["connector"]["offloading"]["capacity_chunks"], self.bpc, self.bs,
            " swa" if self.ngroups > 1 else "", " depth2" if self.depth > 1 else "")
        case = {"name": name, "machine": "engine", "config": cfg, "calls": self.calls}
        return case

    def step_choice(self, max_reqs):
        rng, eng = self.rng, self.eng
        inf = eng.in_flight
        unexec = [x for x in inf if x[0] not in eng.executed]
        can_apply = bool(inf) and inf[0][0] in eng.executed
        live = self.live()
        opts = []
        if self.added < max_reqs:
            opts.append(("add", 4 if not live else 2))
        if len(inf) < self.depth:
            opts.append(("schedule", 3))
        if unexec:
            opts.append(("execute", 4))
        if can_apply:
            opts.append(("apply", 4))
        if not inf:
            opts.append(("run_step", 3))
        if live:
            opts.append(("abort", 1.2 if STRESS else 0.35))
        if self.loading_now():
            opts.append(("abort_loading", 0.5))
        opts.append(("abort_dead", 0.05))
        opts.append(("hold", 1.0 if STRESS else 0.5))
        most_pending = max(len(self.pending_jobs(r)) for r in range(self.W))
        if most_pending:
            # stress: let transfers pile up on a held rank, then complete them in any order
            opts.append(("complete", (3.0 if most_pending > 1 else 0.3) if STRESS else 1.5))
        opts.append(("reset", 0.12))
        opts.append(("lookup", 0.5))
        opts.append(("offload_state", 0.35))
        opts.append(("state", 0.25))
        opts.append(("request", 0.25))
        if not inf and rng.random() < 0.5:
            opts.append(("drain_mid", 0.08))
        kind = rng.choices([o[0] for o in opts], [o[1] for o in opts])[0]
        getattr(self, "c_" + kind)()

    # -- call makers ---------------------------------------------------------------------------
    def c_add(self, rid=None):
        rng = self.rng
        if rid is None:
            rid = self.fresh_id()
            # re-use the id of a request the scheduler no longer holds, sometimes
            # (only ids the connector forgot too: vLLM keys its offloading state by request id, and a
            # reused id whose old request still has jobs in flight crashes it, KeyError in
            # offloading/scheduler.py; vLLM's front end makes request ids unique)
            # Nor an id a step in flight scheduled: vLLM credits that step's tokens to whatever
            # request holds the id when it is applied (FORMAT.md: out of scope).
            in_flight = {e[0] for (_, _, entries) in self.eng.in_flight for e in entries}
            gone = [x for x in self.eng.prompts
                    if x not in self.eng.s.requests and x not in self.eng.osched._req_status
                    and x not in self.eng.s.finished_req_ids and x not in in_flight]
            if gone and rng.random() < 0.08:
                rid = rng.choice(gone)
                self.stats["id_reuse"] += 1
        mt = rng.randint(1, max(1, min(24, self.max_total - 1)))
        limit = self.max_total - mt
        a = {"id": rid}
        if rng.random() < 0.12:
            a["prompt_len"] = rng.randint(1, max(1, min(limit, 64)))
        else:
            a["prompt"] = self.make_prompt(limit)
        a["max_tokens"] = mt
        if rng.random() < 0.15:
            a["stop_token"] = rng.randint(1, 999)
            self.stops[rid] = a["stop_token"]
        self.added += 1
        self.do("add_request", a)

    def c_schedule(self):
        self.do("schedule")

    def c_execute(self):
        self.do("execute")

    def c_apply(self):
        rng, eng = self.rng, self.eng
        step, so, entries = eng.in_flight[0]
        a = {}
        sampled = {}
        for rid, samples, pos in entries:
            if samples and rid in self.stops and rng.random() < 0.3:
                sampled[rid] = [self.stops[rid]]
        if sampled:
            a["sampled"] = sampled
            self.stats["stop_by_sampled"] += 1
        if rng.random() < 0.15:
            a["step"] = step
        self.do("apply_output", a)

    def c_run_step(self):
        self.do("run_step")

    def c_abort(self):
        live = self.live()
        rid = self.rng.choice(live)
        self.do("abort", {"id": rid})

    def loading_now(self):
        W = self.O.RequestStatus.WAITING_FOR_REMOTE_KVS
        return [rid for rid, r in self.eng.s.requests.items() if r.status == W]

    def c_abort_loading(self):
        self.do("abort", {"id": self.rng.choice(self.loading_now())})

    def c_abort_dead(self):
        dead = [x for x in self.eng.prompts if x not in self.live()]
        rid = self.rng.choice(dead) if dead and self.rng.random() < 0.7 else "never"
        self.do("abort", {"id": rid})

    def c_hold(self):
        rng = self.rng
        r = rng.randrange(self.W)
        held = self.eng.workers[r].connector_worker.worker.held
        a = {"rank": r}
        if held:
            a["value"] = False if rng.random() < 0.85 else True
        elif rng.random() < 0.3:
            a["value"] = True
        self.do("hold", a)
        self.stats["holds"] += bool(a.get("value", True))

    def c_complete(self):
        rng = self.rng
        ranks = [r for r in range(self.W) if self.pending_jobs(r)]
        r = rng.choice(ranks)
        p = self.pending_jobs(r)
        if rng.random() < 0.4:
            self.do("complete", {"rank": r})
            return
        if STRESS and rng.random() < 0.5:
            # Any of the transfers awaiting completion, in any order: each completes after the
            # transfers ahead of it in its queue (FORMAT.md, simulated DMA (c)), in both runners.
            jobs = rng.sample(p, rng.randint(1, len(p)))
            if len(jobs) > 1 and jobs != sorted(jobs):
                self.stats["completed_out_of_order"] += 1
            self.do("complete", {"rank": r, "jobs": jobs})
            return
        # The transfers of one queue run serially (FORMAT.md, simulated DMA (c)): name a prefix
        # of each queue's transfers awaiting completion, queues interleaved at random (the
        # stress profile above also names them in any order: both runners then complete the
        # transfers ahead of a named job first).
        dma = self.eng.workers[r].connector_worker.worker
        per_queue = []
        for q in ("store", "load", "exp"):
            pend = [t.job for t in dma.queues[q] if not t.done]
            per_queue.append(pend[:rng.randint(0, len(pend))])
        if not any(per_queue):
            per_queue = [[q[0]] for q in ([t.job for t in dma.queues[k] if not t.done]
                                          for k in ("store", "load", "exp")) if q][:1]
        jobs = []
        while any(per_queue):
            q = rng.choice([x for x in per_queue if x])
            jobs.append(q.pop(0))
        self.do("complete", {"rank": r, "jobs": jobs})

    def c_reset(self):
        self.do("reset_cache")
        if not self.done and self.rng.random() < 0.1:
            self.stats["reset_twice"] += 1
            self.do("reset_cache")

    def c_lookup(self):
        rng = self.rng
        if self.eng.prompts and rng.random() < 0.7:
            self.do("lookup", {"id": rng.choice(sorted(self.eng.prompts))})
        else:
            self.do("lookup", {"prompt": self.make_prompt(self.max_total)})

    def c_offload_state(self):
        self.do("offload_state")

    def c_state(self):
        self.do("state")

    def c_request(self):
        ids = sorted(self.eng.prompts)
        rid = self.rng.choice(ids) if ids and self.rng.random() < 0.9 else "never"
        self.do("request", {"id": rid})

    def c_drain_mid(self):
        self.c_drain()

    def c_drain(self):
        rng = self.rng
        held = any(w.connector_worker.worker.held for w in self.eng.workers)
        a = {}
        if held:
            a["max_steps"] = rng.randint(1, 6)
        elif rng.random() < 0.2:
            a["max_steps"] = rng.randint(1, 30)
        ok, v = self.do("drain", a)
        if ok:
            self.stats["drained"] += 1

    def finish(self):
        """Flush the pipeline, release the ranks, drain to quiescence, then look around."""
        rng, eng = self.rng, self.eng
        for _ in range(8):
            if self.done or not eng.in_flight:
                break
            if eng.in_flight[0][0] in eng.executed:
                self.c_apply()
            else:
                self.c_execute()
        if self.done or eng.in_flight:
            return
        for r in range(self.W):
            if eng.workers[r].connector_worker.worker.held and rng.random() < 0.9:
                self.do("hold", {"rank": r, "value": False})
        if self.done:
            return
        self.c_drain()
        self.stats["ends_with_drain"] += 1
        for _ in range(rng.randint(0, 3)):
            if self.done:
                break
            rng.choice([self.c_offload_state, self.c_lookup, self.c_lookup, self.c_state])()

    # -- typed errors (valid input, documented error kinds) ------------------------------------
    def typed_error(self):
        rng, eng = self.rng, self.eng
        inf = eng.in_flight
        unexec = [x for x in inf if x[0] not in eng.executed]
        ch = []
        if unexec:
            ch.append(lambda: self.do("execute", {"step": unexec[0][0] + rng.randint(1, 3)}))   # step_out_of_order
        else:
            ch.append(lambda: self.do("execute"))                                                 # not_scheduled
        if inf:
            ch.append(lambda: self.do("apply_output", {"step": inf[0][0] + 1}))                  # step_out_of_order
            ch.append(lambda: self.do("run_step"))                                                # step_out_of_order
            ch.append(lambda: self.do("drain"))                                                   # step_out_of_order
            if inf[0][0] not in eng.executed:
                ch.append(lambda: self.do("apply_output"))                                        # not_executed
            else:
                sched = {e[0] for e in inf[0][2]}
                others = [x for x in eng.prompts if x not in sched]
                if others and "sampled_not_scheduled" not in AVOID:
                    ch.append(lambda: self.do("apply_output", {"sampled": {rng.choice(others): [7]}}))  # not_scheduled
        else:
            ch.append(lambda: self.do("apply_output"))                                            # step_out_of_order
        if len(inf) >= self.depth:
            ch.append(lambda: self.do("schedule"))                                                # pipeline_full
        ch.append(lambda: self.do("hold", {"rank": self.W + rng.randint(0, 2)}))                 # rank_out_of_range
        ch.append(lambda: self.do("complete", {"rank": self.W}))                                  # rank_out_of_range
        nj = eng.osched._job_counter

        def bad_complete():
            r = rng.randrange(self.W)
            p = self.pending_jobs(r)
            if p and rng.random() < 0.5:
                self.do("complete", {"rank": r, "jobs": [p[0], p[0]]})                         # named twice
            else:
                cand = [j for j in range(nj + 3) if j not in p]
                self.do("complete", {"rank": r, "jobs": [rng.choice(cand)]})
        ch.append(bad_complete)
        if eng.s.requests:
            ch.append(lambda: self.do("add_request", {"id": rng.choice(sorted(eng.s.requests)),
                                                      "prompt": self.toks(5), "max_tokens": 2}))  # duplicate_request
        ch.append(lambda: self.do("add_request", {"id": self.fresh_id(), "prompt": self.toks(3), "max_tokens": 0}))
        ch.append(lambda: self.do("add_request", {"id": self.fresh_id(), "prompt_len": 512, "max_tokens": 1}))
        ch.append(self.lookup_unknown)                                                           # unknown_request
        rng.choice(ch)()


    def lookup_unknown(self):
        # The fake sampler's token depends on the order request ids are first named (the runners'
        # interners); the oracle does not intern an id on `lookup`, kvrelay does. Name the id first
        # in a call both intern (`request`), so the typed error does not shift later tokens.
        if not self.named_nobody:
            self.named_nobody = True
            self.do("request", {"id": "nobody"})
        if not self.done:
            self.do("lookup", {"id": "nobody"})


def gen_case(seed, idx):
    g = Gen(seed, idx)
    for attempt in range(5):
        try:
            case = g.build()
            return case, g
        except oracle().CaseErr as e:       # config rejected: retry with the RNG moved on
            g.calls, g.stats, g.errors, g.done = [], collections.Counter(), collections.Counter(), False
            g.stats["config_rejected"] += 1
            g.reject = repr(e.args)
    raise RuntimeError("five configs rejected in a row for %d/%d: %s" % (seed, idx, g.reject))


def case_file(seed, idx):
    return "od-s%d-%05d.json" % (seed, idx)


def write_case(path, case):
    """The examples' layout (same as vllm_engine_ref.write_case): one call per line, expect on the next."""
    out = ["{", '  "name": %s,' % json.dumps(case["name"])]
    for k in case:
        if k not in ("name", "calls"):
            out.append("  %s: %s," % (json.dumps(k), json.dumps(case[k], sort_keys=True)))
    out.append('  "calls": [')
    lines = []
    for c in case["calls"]:
        head = {k: c[k] for k in c if k not in ("expect", "expect_error")}
        s = "    " + json.dumps(head)[:-1]
        if "expect" in c:
            s += ',\n      "expect": ' + json.dumps(c["expect"], sort_keys=True) + "}"
        elif "expect_error" in c:
            s += ',\n      "expect_error": ' + json.dumps(c["expect_error"]) + "}"
        else:
            s += "}"
        lines.append(s)
    out += [",\n".join(lines), "  ]", "}"]
    open(path, "w").write("\n".join(out) + "\n")


def worker_gen(seed, start, end, outdir):
    """Worker: generates cases [start, end), one JSON line of stats per case on stdout."""
    adir = outdir.rstrip("/") + "-asserts"
    for i in range(start, end):
        t0 = time.time()
        case, g = gen_case(seed, i)
        info = {"idx": i, "stats": dict(g.stats), "errors": dict(g.errors), "secs": time.time() - t0}
        if g.assert_info is not None:
            os.makedirs(adir, exist_ok=True)
            write_case(os.path.join(adir, case_file(seed, i)), case)
            case["calls"] = case["calls"][:g.assert_info["index"]]
            info["assert"] = g.assert_info
        info["ncalls"] = len(case["calls"])
        write_case(os.path.join(outdir, case_file(seed, i)), case)
        print(json.dumps(info), flush=True)


def first_diff(case):
    """Index of the first call whose oracle result differs from the case's expectation, or None."""
    O = oracle()
    try:
        res = run_calls(case)
    except O.CaseErr as e:
        return 0
    for i, (c, got) in enumerate(zip(case["calls"], res)):
        if "expect_error" in c:
            exp = ["error", c["expect_error"]]
        elif "expect" in c:
            exp = ["value", c["expect"]]
        else:
            continue
        if exp != list(got):
            return i
    return None


def worker_check(files):
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


def generate(n, outdir, seed, jobs, hash_seeds, replay_same=False, avoid=""):
    bad = set(filter(None, avoid.split(","))) - set(AVOIDABLE)
    if bad:
        sys.exit("unknown --avoid %s" % sorted(bad))
    os.environ["VLLM_OFFLOAD_DIFF_AVOID"] = avoid
    os.makedirs(outdir, exist_ok=True)
    for f in os.listdir(outdir):
        if f.startswith("od-s") and f.endswith(".json"):
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
        if len(infos) - last[0] >= 200:
            last[0] = len(infos)
            print("  generated %d/%d (%.1f cases/s)" % (len(infos), n, len(infos) / (time.time() - t0)), flush=True)
    run_parallel([(["_gen", str(seed), str(a), str(b), outdir], GEN_HASHSEED) for a, b in splits(n, jobs)], on_gen)
    tgen = time.time() - t0
    print("generated %d cases in %.1fs (%.1f cases/s)" % (n, tgen, n / max(tgen, 1e-9)), flush=True)

    # hash-seed dependence: re-run under other seeds, truncate at the first differing call
    files = [os.path.join(outdir, case_file(seed, i)) for i in range(n)]
    t1 = time.time()
    seeds = list(hash_seeds) + ([int(GEN_HASHSEED)] if replay_same else [])
    diffs = collections.defaultdict(dict)   # file -> {hashseed: idx}
    for hs in seeds:
        def on_chk(d, hs=hs):
            if d["diff"] is not None:
                diffs[d["file"]][hs] = d["diff"]
        run_parallel([(["_check"] + files[a:b], hs) for a, b in splits(len(files), jobs)], on_chk)
    trunc = {"cases_truncated": 0, "calls_cut": 0, "same_seed_replay_mismatch": [], "by_call": collections.Counter(),
             "dropped_empty": 0}
    for f, d in sorted(diffs.items()):
        if int(GEN_HASHSEED) in d:
            trunc["same_seed_replay_mismatch"].append(os.path.basename(f))
        cut = min(d.values())
        case = json.load(open(f))
        trunc["cases_truncated"] += 1
        trunc["calls_cut"] += len(case["calls"]) - cut
        trunc["by_call"][case["calls"][cut]["call"]] += 1
        trunc.setdefault("files", []).append("%s@%d" % (os.path.basename(f), cut))
        case["calls"] = case["calls"][:cut]
        if not case["calls"]:
            os.remove(f)
            trunc["dropped_empty"] += 1
            continue
        case["name"] += " (truncated at call %d: hash-seed dependent)" % cut
        write_case(f, case)
    tchk = time.time() - t1
    print("hash-seed check (seeds %s) in %.1fs: %d cases truncated" % (seeds, tchk, trunc["cases_truncated"]), flush=True)

    mix = summarize_mix(infos, trunc, n, tgen, tchk)
    mix.update(seed=seed, hash_seeds=seeds, avoid=avoid, profile=PROFILE, finished_order=FINISHED_ORDER)
    json.dump(mix, open(os.path.join(outdir, "MIX.json"), "w"), indent=1, sort_keys=True)
    print_mix(mix)
    return mix


def summarize_mix(infos, trunc, n, tgen, tchk):
    tot = collections.Counter()
    cases_with = collections.Counter()
    errs = collections.Counter()
    asserts = collections.Counter()
    assert_examples = {}
    for d in infos.values():
        for k, v in d["stats"].items():
            tot[k] += v
            if v:
                cases_with[k] += 1
        for k, v in d["errors"].items():
            errs[k] += v
        if "assert" in d:
            a = d["assert"]
            key = a["kind"] + " on " + a["call"]
            asserts[key] += 1
            assert_examples.setdefault(key, case_file(0, d["idx"]).replace("s0-", "s?-"))
    return {"cases": n, "gen_seconds": round(tgen, 1), "check_seconds": round(tchk, 1),
            "totals": dict(sorted(tot.items())), "cases_with": dict(sorted(cases_with.items())),
            "typed_errors": dict(sorted(errs.items())),
            "internal_asserts": dict(asserts), "internal_assert_example_files": assert_examples,
            "hash_seed": {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in trunc.items()}}


def print_mix(m):
    t, c = m["totals"], m["cases_with"]
    print("case mix (%d cases, %d calls):" % (m["cases"], t.get("calls", 0)))
    cfg = ["W=1", "W=2", "W=3", "W=4", "policy_lru", "policy_arc", "non_writers", "swa", "prefix_caching_off",
           "async_depth_2", "gpu_pressure", "sync_budget", "store_threshold>1", "offload_all_tokens",
           "capacity_small(<=6)", "bs=4"]
    print("  configs: " + ", ".join("%s %d" % (k, t.get(k, 0)) for k in cfg))
    ev = ["steps", "preemptions", "resumed", "load_jobs", "sync_load_jobs", "store_jobs", "jobs_to_flush",
          "flushed_transfers", "sync_waited", "transfers_stored", "transfers_loaded", "completed_jobs_by_hand",
          "holds", "reset_true", "reset_false", "reset_with_jobs_in_flight", "reset_twice", "aborts_true",
          "abort_while_loading", "ev_stored", "ev_removed", "lookup_hit", "lookup_hit_pending", "drained",
          "ends_with_drain", "finish_stopped", "finish_length_capped", "finish_aborted", "finish_error",
          "stop_by_sampled", "id_reuse", "config_rejected", "finished_together", "completed_out_of_order"]
    print("  events (total / cases with it):")
    for i in range(0, len(ev), 4):
        print("    " + "; ".join("%s %d/%d" % (k, t.get(k, 0), c.get(k, 0)) for k in ev[i:i + 4]))
    print("  typed errors: " + ", ".join("%s %d" % kv for kv in m["typed_errors"].items()))
    sticky = {k: v for k, v in t.items() if k.startswith("sticky:")}
    print("  sticky errors ending a case: %s" % (sticky or "none"))
    print("  internal asserts (call cut from the case): %s" % (m["internal_asserts"] or "none"))
    h = m["hash_seed"]
    print("  hash-seed truncations: %d cases, %d calls cut, first differing call: %s; dropped (empty) %d; "
          "same-seed replay mismatches: %s" % (h["cases_truncated"], h["calls_cut"], h["by_call"], h["dropped_empty"],
                                               h["same_seed_replay_mismatch"] or "none"))


FAIL_RE = re.compile(r"^FAIL (.*?): call (\d+) \(([a-z_]+)\): (.*)$")


def run_kvrelay(kvrelay, path):
    """`kvrelay conformance` on a case file, or on the generated cases of a folder (DIR/MIX.json is
    not a case, so the folder itself is not passed)."""
    if os.path.isdir(path):
        paths = sorted(os.path.join(path, f) for f in os.listdir(path) if f.startswith("od-s") and f.endswith(".json"))
    else:
        paths = [path]
    out = []
    for i in range(0, len(paths), 2000):
        p = subprocess.run([kvrelay, "conformance"] + paths[i:i + 2000], capture_output=True, text=True)
        out.append(p.stdout + p.stderr)
    return "\n".join(out)


def cmd_run(a):
    generate(a.n, a.dir, a.seed, a.jobs, a.hash_seeds, a.replay_same, a.avoid)
    t0 = time.time()
    out = run_kvrelay(a.kvrelay, a.dir)
    tk = time.time() - t0
    passed = failed = 0
    groups = collections.defaultdict(list)
    other = []
    for line in out.splitlines():
        if line.startswith("PASS "):
            passed += 1
        elif line.startswith("FAIL "):
            failed += 1
            m = FAIL_RE.match(line)
            if m:
                groups[m.group(3)].append(line)
            else:
                groups["(no call)"].append(line)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    print("kvrelay (%.1fs): %s" % (tk, last))
    print("cases %d, passed %d, failed %d" % (passed + failed, passed, failed))
    for k, lst in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print("  first differing call %-14s %d" % (k, len(lst)))
        for line in lst[:3]:
            print("    " + (line if len(line) < 400 else line[:400] + " ..."))
    open(os.path.join(a.dir, "KVRELAY.txt"), "w").write(out)
    return 1 if failed else 0


# -- shrinking ---------------------------------------------------------------------------------

def refill(case):
    res = run_calls(case)
    calls = []
    for c, got in zip(case["calls"], res):
        c = {k: v for k, v in c.items() if k not in ("expect", "expect_error")}
        if got[0] == "error":
            c["expect_error"] = got[1]
        else:
            c["expect"] = jcopy(got[1])
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


def cmd_shrink(a):
    if os.environ.get("PYTHONHASHSEED") != GEN_HASHSEED:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED=GEN_HASHSEED))
    case = json.load(open(a.case))
    tmp = tempfile.mkdtemp(prefix="odshrink")
    last = case["calls"][-1].get("expect_error", "")
    if last.startswith("internal_assert"):
        # a case from DIR-asserts: keep vLLM failing the same way (the oracle is the only judge)
        sig = last
        print("vLLM failure: call %d (%s): %s" % (len(case["calls"]) - 1, case["calls"][-1]["call"], sig))

        def kv_fail_(kvrelay, c, tmp):
            for i, x in enumerate(c["calls"]):
                if x.get("expect_error") == sig:
                    return sig, i, sig
            return None
    else:
        kv_fail_ = kv_fail
    f0 = kv_fail_(a.kvrelay, case, tmp)
    if f0 is None:
        sys.exit("the case passes kvrelay")
    sig = f0[0]
    print("failure: call %d (%s): %s" % (f0[1], f0[0], f0[2][:300]))
    calls = case["calls"]
    # never go past the failing call
    calls = calls[:f0[1] + 1]

    crash_case = last.startswith("internal_assert")

    def test(cs):
        try:
            c = refill(dict(case, calls=cs))
        except Exception:
            return None
        if not crash_case and any(x.get("expect_error", "").startswith("internal_assert")
                                  for x in c["calls"]):
            # dropping calls made vLLM crash: a different failure, not a smaller one
            return None
        r = kv_fail_(a.kvrelay, c, tmp)
        return c if r is not None and r[0] == sig else None

    best = test(calls)
    if best is None:
        best = case
    calls = best["calls"]
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
                r2 = kv_fail_(a.kvrelay, r, tmp)
                best, calls = r, r["calls"][:r2[1] + 1]
                n = max(n - 1, 2)
                reduced = True
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(calls), n * 2)
    best = refill(dict(case, calls=calls))
    r = kv_fail_(a.kvrelay, best, tmp)
    best["name"] = case["name"] + " (shrunk)"
    out = a.out or a.case.replace(".json", "") + "-shrunk.json"
    write_case(out, best)
    print("shrunk to %d calls -> %s\n  call %d (%s): %s" % (len(best["calls"]), out, r[1], r[0], r[2][:600]))


def cmd_regen(a):
    if os.environ.get("PYTHONHASHSEED") != GEN_HASHSEED:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED=GEN_HASHSEED))
    os.makedirs(a.dir, exist_ok=True)
    worker_gen(a.seed, a.index, a.index + 1, a.dir)


def cmd_fill(a):
    """Rewrite each case's expectations with vLLM's answers (in the chosen finished order), ending
    it at the first sticky error; the calls are kept."""
    if os.environ.get("PYTHONHASHSEED") != GEN_HASHSEED:
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED=GEN_HASHSEED))
    for path in a.cases:
        case = json.load(open(path))
        filled = refill(case)
        changed = sum(1 for x, y in zip(case["calls"], filled["calls"]) if x != y)
        write_case(path, filled)
        print("filled %s: %d of %d calls changed%s" % (path, changed, len(case["calls"]),
                                                       "" if len(filled["calls"]) == len(case["calls"])
                                                       else ", cut at a sticky error"))
    return 0


def cmd_check(a):
    """OK or BAD per case: vLLM's answers (in the chosen finished order) against the case's
    expectations, compared as vllm_offload_ref.py compares them; BAD names the first differing
    call. Exit status 1 on any BAD."""
    O = oracle()
    bad = 0
    for path in a.cases:
        case = json.load(open(path))
        if not isinstance((case.get("config") or {}).get("connector"), dict):
            print("SKIP " + path + " (not the offloading connector)")
            continue
        res = run_calls(case)
        diff = None
        for i, (c, got) in enumerate(zip(case["calls"], res)):
            exp = (["error", c["expect_error"]] if "expect_error" in c
                   else ["value", c["expect"]] if "expect" in c else None)
            if exp is not None and O.E.norm(tuple(exp)) != O.E.norm(tuple(got)):
                diff = (i, c["call"], got)
                break
        if diff is None:
            print("OK   " + path)
        else:
            bad += 1
            print("BAD  %s: call %d (%s): vLLM gives %s" % (path, diff[0], diff[1], json.dumps(diff[2][1])[:300]))
    return 1 if bad else 0


def set_profile(profile, finished_order):
    """The input mix and the oracle's finished order, for this process and the workers it spawns."""
    global PROFILE, STRESS, FINISHED_ORDER
    PROFILE, STRESS, FINISHED_ORDER = profile, profile == "stress", finished_order
    os.environ["VLLM_OFFLOAD_DIFF_PROFILE"] = profile
    os.environ["VLLM_OFFLOAD_DIFF_FINISHED_ORDER"] = finished_order


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_gen":
        seed, start, end, outdir = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        return worker_gen(seed, start, end, outdir)
    if len(sys.argv) > 1 and sys.argv[1] == "_check":
        return worker_check(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPUs)")
        p.add_argument("--hash-seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4],
                       help="PYTHONHASHSEED values to re-check every case under (default 1,2,3,4: an order "
                            "that depends on a 2-element set escapes k seeds with probability 2^-k)")
        p.add_argument("--replay-same", action="store_true",
                       help="also replay every case under the generation seed (0) in fresh processes: "
                            "checks that no state leaks between the cases of one generator process")
        p.add_argument("--avoid", default="", help="comma list of known failure shapes to leave out: " +
                       "; ".join("%s = %s" % kv for kv in AVOIDABLE.items()))
    g = sub.add_parser("generate", help="generate N cases with vLLM's results into DIR (+ DIR/MIX.json)")
    g.add_argument("n", type=int)
    g.add_argument("dir")
    common(g)
    r = sub.add_parser("run", help="generate, run `kvrelay conformance DIR`, summarise; exit 1 on failures")
    r.add_argument("n", type=int)
    r.add_argument("dir")
    common(r)
    r.add_argument("--kvrelay", default=DEFAULT_KVRELAY, help="kvrelay binary (default target/release/kvrelay)")
    s = sub.add_parser("shrink", help="delta-debug a failing case (oracle re-fills the expectations)")
    s.add_argument("case")
    s.add_argument("--out")
    s.add_argument("--kvrelay", default=DEFAULT_KVRELAY)
    rg = sub.add_parser("regen", help="regenerate case INDEX of seed SEED into DIR")
    rg.add_argument("seed", type=int)
    rg.add_argument("index", type=int)
    rg.add_argument("dir")
    f = sub.add_parser("fill", help="rewrite the expectations of CASE... with vLLM's answers")
    f.add_argument("cases", nargs="+")
    c = sub.add_parser("check", help="OK / BAD per CASE...: vLLM's answers against its expectations")
    c.add_argument("cases", nargs="+")
    for p in (g, r, s, rg, f, c):
        p.add_argument("--profile", choices=sorted(PROFILES), default="default",
                       help="input mix: " + "; ".join("%s = %s" % kv for kv in sorted(PROFILES.items())))
        p.add_argument("--finished-order", choices=["finish", "set"], default="finish",
                       help="how vLLM's scheduler iterates finished_req_ids: `finish` (default, kvrelay's "
                            "documented order) or `set` (vLLM's own hash-seed order)")
    a = ap.parse_args()
    set_profile(a.profile, a.finished_order)
    if a.cmd == "generate":
        generate(a.n, a.dir, a.seed, a.jobs, a.hash_seeds, a.replay_same, a.avoid)
        return 0
    if a.cmd == "run":
        return cmd_run(a)
    if a.cmd == "shrink":
        return cmd_shrink(a)
    if a.cmd == "regen":
        return cmd_regen(a)
    if a.cmd == "fill":
        return cmd_fill(a)
    if a.cmd == "check":
        return cmd_check(a)


if __name__ == "__main__":
    sys.exit(main())
