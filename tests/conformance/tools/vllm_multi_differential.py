#!/usr/bin/env python3
"""Differential check of kvrelay's `multi` conformance machine against vLLM 0.33.0's own code.

Loads vLLM's `multi_connector.py` with its imports stubbed (no torch, no vLLM install needed),
composes it of trivial children whose answers each call supplies, and either

  replay CASE...           runs `multi` cases (FORMAT.md) against vLLM and prints PASS/FAIL, or
  generate N DIR           writes N random `multi` cases whose expectations vLLM produced,
                           to be run with `kvrelay conformance DIR`.

The scheduler side and the worker side are two MultiConnector instances, as in vLLM. Exceptions
map to the error kinds of the machine: RuntimeError -> params_conflict, ValueError ->
finished_count_conflict, AssertionError/IndexError -> meta_mismatch.

VLLM_MULTI_CONNECTOR names the source file (default: the path below).
"""
import glob, json, os, random, sys, types
from dataclasses import dataclass, field

def mod(name, **attrs):
    m = types.ModuleType(name); m.__dict__.update(attrs); sys.modules[name] = m; return m

class Any_: 
    def __init__(self,*a,**k): pass
mod('torch', Tensor=Any_)
for n in ['vllm','vllm.config','vllm.distributed','vllm.distributed.kv_transfer','vllm.distributed.kv_transfer.kv_connector',
          'vllm.distributed.kv_transfer.kv_connector.v1','vllm.v1','vllm.v1.attention','vllm.v1.core','vllm.v1.core.sched','vllm.v1.metrics']:
    mod(n)
sys.modules['vllm.config'].VllmConfig = Any_
mod('vllm.config.kv_transfer', KVTransferConfig=Any_)
mod('vllm.distributed.kv_transfer.kv_connector.base', KVConnectorBaseType=Any_)
mod('vllm.distributed.kv_transfer.kv_connector.factory', KVConnectorFactory=Any_)

class KVConnectorBase_V1:
    def bind_connector_metadata(self, m): self._connector_metadata = m
    def clear_connector_metadata(self): self._connector_metadata = None
class SupportsHMA: pass
class KVConnectorMetadata: pass
class KVConnectorWorkerMetadata: pass
@dataclass
class KVConnectorTransferResults:
    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)
mod('vllm.distributed.kv_transfer.kv_connector.v1.base', CopyBlocksOp=Any_, KVConnectorBase_V1=KVConnectorBase_V1,
    KVConnectorHandshakeMetadata=Any_, KVConnectorMetadata=KVConnectorMetadata, KVConnectorRole=Any_,
    KVConnectorTransferResults=KVConnectorTransferResults, KVConnectorWorkerMetadata=KVConnectorWorkerMetadata, SupportsHMA=SupportsHMA)
@dataclass
class KVConnectorStats:
    data: dict = field(default_factory=dict)
mod('vllm.distributed.kv_transfer.kv_connector.v1.metrics', KVConnectorPromMetrics=Any_, KVConnectorStats=KVConnectorStats, PromMetric=Any_, PromMetricT=Any_)
import logging
mod('vllm.logger', init_logger=lambda n: logging.getLogger(n))
mod('vllm.v1.attention.backend', AttentionMetadata=Any_)
mod('vllm.v1.core.sched.output', SchedulerOutput=Any_)
mod('vllm.v1.metrics.cache_hit_source', CacheHitSource=Any_)
@dataclass
class KVConnectorOutput:
    kv_connector_worker_meta: object = None
mod('vllm.v1.outputs', KVConnectorOutput=KVConnectorOutput)

src = open(os.environ.get('VLLM_MULTI_CONNECTOR', '/tmp/vllm-dl/src/vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py')).read()
mc_mod = types.ModuleType('multi_connector'); exec(compile(src, 'multi_connector.py', 'exec'), mc_mod.__dict__)
MultiConnector = mc_mod.MultiConnector
MultiMeta = mc_mod.MultiKVConnectorMetadata
MultiWMeta = mc_mod.MultiKVConnectorWorkerMetadata

class Child(KVConnectorBase_V1):
    def __init__(self):
        self.finish = None; self.lookup = None; self.count = None; self.sending = set(); self.seen = 'unset'
    def request_finished(self, req, blocks): return self.finish
    def get_num_new_matched_tokens(self, req, n): return self.lookup
    def get_finished_count(self): return self.count
    def get_transfer_results(self, ids):
        r = KVConnectorTransferResults(finished_sending=self.sending); self.sending = set(); return r
    def update_connector_output(self, out): self.seen = out.kv_connector_worker_meta
    def build_connector_meta(self, out): return None

class Req:
    def __init__(self, rid): self.request_id = rid

def new(k):
    m = object.__new__(MultiConnector)
    m._connectors = [Child() for _ in range(k)]
    m._requests_to_connector = {}; m._extra_async_saves = {}
    return m

class Opaque:
    def __init__(self, j): self.j = j
def to_py(j):
    if j is None: return None
    if 'multi' in j: return MultiWMeta(metadata=tuple(to_py(x) for x in j['multi']))
    return Opaque(j)
def norm(j):
    if j is None: return None
    if 'multi' in j: return {'multi':[norm(x) for x in j['multi']]}
    if 'set' in j: return {'set': sorted(set(j['set']))}
    if 'offload' in j:
        o=j['offload']; return {'offload':{'completed_jobs':{str(k):v for k,v in o.get('completed_jobs',{}).items()},'bytes':o.get('bytes',0),'transfers':o.get('transfers',0)}}
def from_py(p):
    if p is None: return None
    if isinstance(p, MultiWMeta): return {'multi':[from_py(x) for x in p.metadata]}
    return norm(p.j)


def apply(sched, worker, k, c):
    a = c.get('args', {}); call = c['call']
    try:
        if call == 'request_finished':
            for ch, r in zip(sched._connectors, a['results']):
                ch.finish = (r['delay'], None if r.get('params') is None else dict(r['params']))
            d, p = sched.request_finished(Req(a['request']), [])
            return ('ok', {'delay': d, 'params': None if p is None else dict(p)})
        if call == 'build_meta':
            e = sched.build_connector_meta(None).extra_async_saves
            return ('ok', {'extra_async_saves': None if e is None else dict(e)})
        if call == 'bind':
            worker.bind_connector_metadata(MultiMeta(metadata=tuple([None]*k), extra_async_saves=a.get('extra_async_saves')))
            return ('ok', 'ok')
        if call == 'child_finished_sending':
            worker._connectors[a['child']].sending = set(a['ids'])
            return ('ok', sorted(worker.get_transfer_results(set()).finished_sending))
        if call == 'matched_tokens':
            for ch, t in zip(sched._connectors, a['answers']):
                ch.lookup = (t, False)
            t, _ = sched.get_num_new_matched_tokens(Req(a['request']), 0)
            return ('ok', {'tokens': t, 'chosen': sched._requests_to_connector.get(a['request'])})
        if call == 'finished_count':
            for ch, n in zip(sched._connectors, a['counts']): ch.count = n
            return ('ok', sched.get_finished_count())
        if call == 'route_worker_meta':
            out = KVConnectorOutput(kv_connector_worker_meta=to_py(a.get('meta')))
            for ch in sched._connectors: ch.seen = 'unset'
            sched.update_connector_output(out)
            return ('ok', [from_py(ch.seen) for ch in sched._connectors])
    except RuntimeError: return ('err', 'params_conflict')
    except ValueError: return ('err', 'finished_count_conflict')
    except (AssertionError, IndexError): return ('err', 'meta_mismatch')

R = ['A', 'B', 'C']
def rmeta(k, depth=0):
    x = random.random()
    if x < 0.3: return None
    if x < 0.5: return {'set': random.sample(['x','y','z'], random.randint(0,2))}
    if x < 0.65: return {'offload': {'completed_jobs': {str(random.randint(0,3)): random.randint(1,3)}}}
    n = k if random.random() < 0.8 or depth else k + random.choice([-1, 1])
    return {'multi': [rmeta(k, depth+1) if random.random() < 0.5 else None for _ in range(max(n,0))]}

def gen(seed):
    random.seed(seed)
    k = random.randint(1, 4)
    sched, worker = new(k), new(k)
    calls = []; last_extra = None
    for _ in range(random.randint(3, 25)):
        t = random.choice(['rf','rf','bm','bind','cfs','cfs','cfs','mt','mt','fc','rw'])
        if t == 'rf':
            res = []
            for _ in range(k):
                p = None
                if random.random() < 0.4:
                    p = {key: random.randint(0,9) for key in random.sample(['a','b','c','d','e','f'], random.randint(0,2))}
                res.append({'delay': random.random() < 0.6, 'params': p})
            c = {'call': 'request_finished', 'args': {'request': random.choice(R), 'results': res}}
        elif t == 'bm':
            c = {'call': 'build_meta'}
        elif t == 'bind':
            if last_extra is not None and random.random() < 0.7: e = last_extra
            elif random.random() < 0.5: e = None
            else: e = {r: random.randint(1,3) for r in random.sample(R, random.randint(0,2))}
            c = {'call': 'bind', 'args': {'extra_async_saves': e}}
        elif t == 'cfs':
            c = {'call': 'child_finished_sending', 'args': {'child': random.randrange(k), 'ids': random.sample(R, random.randint(0,3))}}
        elif t == 'mt':
            c = {'call': 'matched_tokens', 'args': {'request': random.choice(R), 'answers': [random.choice([None,0,0,0,5,16]) for _ in range(k)]}}
        elif t == 'fc':
            c = {'call': 'finished_count', 'args': {'counts': [random.choice([None,1,2,2]) for _ in range(k)]}}
        else:
            c = {'call': 'route_worker_meta', 'args': {'meta': rmeta(k)}}
        r = apply(sched, worker, k, c)
        if t == 'bm' and r[0] == 'ok': last_extra = r[1]['extra_async_saves']
        if r[0] == 'ok': c['expect'] = r[1]
        else: c['expect_error'] = r[1]
        calls.append(c)
    return {'name': f'fuzz {seed}', 'machine': 'multi', 'config': {'children': k}, 'calls': calls}


def replay(case):
    k = case['config']['children']
    sched, worker = new(k), new(k)
    for i, c in enumerate(case['calls']):
        res = apply(sched, worker, k, c)
        call = c['call']
        if 'expect' in c:
            want = c['expect']
            if call == 'route_worker_meta': want = [norm(x) for x in want]
            if call == 'child_finished_sending': want = sorted(set(want))
            ok = res == ('ok', want)
        elif 'expect_error' in c:
            ok = res == ('err', c['expect_error'])
        else:
            ok = res[0] == 'ok'
        if not ok:
            return f'call {i} ({call}): expected {c.get("expect", c.get("expect_error"))}, vLLM gave {res}'
    return None


if __name__ == '__main__':
    if len(sys.argv) >= 2 and sys.argv[1] == 'replay':
        bad = 0
        for f in sorted(sys.argv[2:]):
            case = json.load(open(f))
            if case['machine'] != 'multi':
                continue
            r = replay(case)
            print(('PASS ' if r is None else 'FAIL ') + case['name'] + ('' if r is None else ': ' + r))
            bad += r is not None
        print(f'{bad} failed')
        sys.exit(1 if bad else 0)
    elif len(sys.argv) == 4 and sys.argv[1] == 'generate':
        os.makedirs(sys.argv[3], exist_ok=True)
        for s in range(int(sys.argv[2])):
            with open(os.path.join(sys.argv[3], f'f{s:05}.json'), 'w') as f:
                json.dump(gen(s), f)
    else:
        sys.exit(__doc__)
