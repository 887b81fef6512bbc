//! The worker step protocol (SEMANTICS.md §2.4, I-1…I-6) against an independent grammar.
//!
//! [`grammar`] is a hand-written LL(1) parser of I-1's sequence, step by step:
//!
//! ```text
//! step := begin_step(shape) handle_preemptions bind
//!         [start_load_kv if sync_loads] ((wait_for_layer_load save_kv_layer)* if forward)
//!         [start_load_kv if not sync_loads] [wait_for_save if not defer_finalize]
//!         get_finished get_block_ids_with_load_errors get_stats? get_events? build_worker_meta
//!         (clear if not defer_finalize | wait_for_save clear if defer_finalize)
//! ```
//!
//! It says where a sequence first leaves the language (or that it is a complete or an unfinished
//! run of steps). [`WorkerProtocol`] must agree exactly: reject the same call first, with the
//! violation sticking for every later call, accept complete runs and end unfinished ones in a
//! phase other than `Idle`. Sequences are legal runs of 1 to 3 random steps, and single
//! mutations of them (a call dropped, two calls swapped, a call or a `begin_step` inserted).

use kvrelay_core::{ProtocolViolation, StepId, StepShape, WorkerCall, WorkerPhase, WorkerProtocol};
use kvrelay_tests::laws::config;
use proptest::prelude::*;
use proptest::sample::Index;

use WorkerCall as C;

/// One event of a rank: a `begin_step` or a connector call.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Ev {
    Begin(StepShape),
    Call(WorkerCall),
}

/// The grammar's verdict on a sequence.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Verdict {
    /// Whole steps, all legal.
    Complete,
    /// Legal so far, but the last step is not finished.
    Unfinished,
    /// The event at this index is the first that no legal run has there.
    Illegal(usize),
}

/// Why a parse stopped.
enum Stop {
    End,
    Bad(usize),
}

struct Parser<'a> {
    ev: &'a [Ev],
    at: usize,
}

impl Parser<'_> {
    fn peek_is(&self, c: WorkerCall) -> bool {
        self.ev.get(self.at) == Some(&Ev::Call(c))
    }

    fn expect(&mut self, c: WorkerCall) -> Result<(), Stop> {
        match self.ev.get(self.at) {
            None => Err(Stop::End),
            Some(&Ev::Call(x)) if x == c => {
                self.at += 1;
                Ok(())
            }
            Some(_) => Err(Stop::Bad(self.at)),
        }
    }

    fn optional(&mut self, c: WorkerCall) {
        if self.peek_is(c) {
            self.at += 1;
        }
    }

    fn step(&mut self, s: StepShape) -> Result<(), Stop> {
        self.expect(C::HandlePreemptions)?;
        self.expect(C::Bind)?;
        if s.sync_loads {
            self.expect(C::StartLoadKv)?;
        }
        if s.forward {
            while self.peek_is(C::WaitForLayerLoad) {
                self.at += 1;
                self.expect(C::SaveKvLayer)?;
            }
        }
        if !s.sync_loads {
            self.expect(C::StartLoadKv)?;
        }
        if !s.defer_finalize {
            self.expect(C::WaitForSave)?;
        }
        self.expect(C::GetFinished)?;
        self.expect(C::GetBlockIdsWithLoadErrors)?;
        self.optional(C::GetStats);
        self.optional(C::GetEvents);
        self.expect(C::BuildWorkerMeta)?;
        if s.defer_finalize {
            self.expect(C::WaitForSave)?;
        }
        self.expect(C::Clear)
    }
}

/// Parses a whole sequence of steps.
fn grammar(ev: &[Ev]) -> Verdict {
    let mut p = Parser { ev, at: 0 };
    loop {
        let shape = match ev.get(p.at) {
            None => return Verdict::Complete,
            Some(Ev::Begin(shape)) => *shape,
            Some(Ev::Call(_)) => return Verdict::Illegal(p.at),
        };
        p.at += 1;
        match p.step(shape) {
            Ok(()) => {}
            Err(Stop::End) => return Verdict::Unfinished,
            Err(Stop::Bad(i)) => return Verdict::Illegal(i),
        }
    }
}

/// Runs `ev` through a fresh [`WorkerProtocol`], checking invariants after every call and that
/// a violation sticks; returns the protocol's verdict.
fn run(ev: &[Ev]) -> Result<Verdict, TestCaseError> {
    let mut p = WorkerProtocol::new();
    let mut first: Option<(usize, ProtocolViolation)> = None;
    // Steps opened so far, and the shape of the last one.
    let (mut steps, mut shape) = (0u64, StepShape::default());
    // Whether metadata is bound, by the grammar's reading: from an accepted `bind` to the
    // step's `clear` (I-2).
    let mut bound = false;
    for (i, e) in ev.iter().enumerate() {
        let phase = p.phase();
        let result = match *e {
            Ev::Begin(s) => p.begin_step(s).map(|id| {
                steps += 1;
                shape = s;
                assert_eq!(id, StepId(steps - 1), "begin_step returns the new step");
            }),
            Ev::Call(c) => p.handle(c),
        };
        match (&first, result) {
            (None, Ok(())) => {
                match *e {
                    Ev::Call(C::Bind) => bound = true,
                    Ev::Call(C::Clear) => bound = false,
                    _ => {}
                }
                prop_assert_eq!(p.is_bound(), bound, "is_bound after event {} {:?}", i, e);
            }
            (None, Err(v)) => {
                let call = match *e {
                    Ev::Begin(_) => None,
                    Ev::Call(c) => Some(c),
                };
                prop_assert_eq!(v.call, call, "violation names the wrong call");
                prop_assert_eq!(v.phase, phase, "violation names the wrong phase");
                prop_assert_eq!(v.step, StepId(steps.saturating_sub(1)), "wrong step");
                prop_assert_eq!(v.shape, shape, "violation names the wrong shape");
                prop_assert_eq!(p.violation(), Some(&v));
                first = Some((i, v));
            }
            (Some((_, v)), Err(again)) => {
                prop_assert_eq!(&again, v, "event {}: the violation did not stick", i);
            }
            (Some((at, _)), Ok(())) => {
                prop_assert!(
                    false,
                    "event {} {:?} accepted after the violation at {}",
                    i,
                    e,
                    at
                );
            }
        }
        if let Err(v) = p.check_invariants() {
            prop_assert!(false, "after event {} {:?}: {}", i, e, v);
        }
    }
    Ok(match first {
        Some((i, _)) => Verdict::Illegal(i),
        None if p.phase() == WorkerPhase::Idle => Verdict::Complete,
        None => Verdict::Unfinished,
    })
}

fn shape() -> impl Strategy<Value = StepShape> {
    (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
        |(sync_loads, forward, defer_finalize)| StepShape {
            sync_loads,
            forward,
            defer_finalize,
        },
    )
}

/// One legal step: a random shape, 0 to 3 layers if it has a forward, optional stats and events.
fn legal_step() -> impl Strategy<Value = Vec<Ev>> {
    (shape(), 0usize..4, any::<bool>(), any::<bool>()).prop_map(|(s, layers, stats, events)| {
        let mut v = vec![
            Ev::Begin(s),
            Ev::Call(C::HandlePreemptions),
            Ev::Call(C::Bind),
        ];
        if s.sync_loads {
            v.push(Ev::Call(C::StartLoadKv));
        }
        if s.forward {
            for _ in 0..layers {
                v.push(Ev::Call(C::WaitForLayerLoad));
                v.push(Ev::Call(C::SaveKvLayer));
            }
        }
        if !s.sync_loads {
            v.push(Ev::Call(C::StartLoadKv));
        }
        if !s.defer_finalize {
            v.push(Ev::Call(C::WaitForSave));
        }
        v.push(Ev::Call(C::GetFinished));
        v.push(Ev::Call(C::GetBlockIdsWithLoadErrors));
        if stats {
            v.push(Ev::Call(C::GetStats));
        }
        if events {
            v.push(Ev::Call(C::GetEvents));
        }
        v.push(Ev::Call(C::BuildWorkerMeta));
        if s.defer_finalize {
            v.push(Ev::Call(C::WaitForSave));
        }
        v.push(Ev::Call(C::Clear));
        v
    })
}

fn legal_run() -> impl Strategy<Value = Vec<Ev>> {
    proptest::collection::vec(legal_step(), 1..4).prop_map(|steps| steps.concat())
}

fn any_event() -> impl Strategy<Value = Ev> {
    prop_oneof![
        1 => shape().prop_map(Ev::Begin),
        6 => proptest::sample::select(WorkerCall::ALL.to_vec()).prop_map(Ev::Call),
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    Drop(Index),
    Swap(Index, Index),
    SwapAdjacent(Index),
    Insert(Index, Ev),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<Index>().prop_map(Mutation::Drop),
        (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::Swap(a, b)),
        any::<Index>().prop_map(Mutation::SwapAdjacent),
        (any::<Index>(), any_event()).prop_map(|(i, e)| Mutation::Insert(i, e)),
    ]
}

impl Mutation {
    /// Applies the mutation; `None` if it leaves the sequence as it was.
    fn apply(&self, ev: &[Ev]) -> Option<Vec<Ev>> {
        let mut v = ev.to_vec();
        let n = v.len();
        match self {
            Mutation::Drop(i) => {
                v.remove(i.index(n));
            }
            Mutation::Swap(a, b) => v.swap(a.index(n), b.index(n)),
            Mutation::SwapAdjacent(i) => {
                let i = i.index(n - 1);
                v.swap(i, i + 1);
            }
            Mutation::Insert(i, e) => v.insert(i.index(n + 1), *e),
        }
        (v != ev).then_some(v)
    }

    /// Whether every legal sequence this changes becomes illegal, whatever the grammar says:
    /// dropping a mandatory call, swapping two different neighbours, inserting a mandatory call.
    fn always_illegal(&self, ev: &[Ev]) -> bool {
        let optional = |e: Ev| matches!(e, Ev::Call(C::GetStats | C::GetEvents));
        match self {
            Mutation::Drop(i) => !optional(ev[i.index(ev.len())]),
            Mutation::SwapAdjacent(_) => true,
            Mutation::Insert(_, e) => !optional(*e) && !matches!(e, Ev::Begin(_)),
            Mutation::Swap(..) => false,
        }
    }
}

proptest! {
    #![proptest_config(config())]

    /// Legal runs are accepted, call by call, and end `Idle`.
    #[test]
    fn legal_sequences_are_accepted(ev in legal_run()) {
        prop_assert_eq!(grammar(&ev), Verdict::Complete, "generator and grammar disagree");
        prop_assert_eq!(run(&ev)?, Verdict::Complete);
    }

    /// Every prefix of a legal run is accepted and, unless it ends a step, leaves the rank
    /// inside a step: `begin_step` there is rejected (I-5).
    #[test]
    fn begin_step_inside_a_step_is_rejected(ev in legal_run(), cut in any::<Index>(), s in shape()) {
        let prefix = &ev[..cut.index(ev.len() + 1)];
        let mut p = WorkerProtocol::new();
        for e in prefix {
            match *e {
                Ev::Begin(shape) => p.begin_step(shape).map(|_| ()),
                Ev::Call(c) => p.handle(c),
            }
            .unwrap();
        }
        let phase = p.phase();
        match p.begin_step(s) {
            Ok(_) => prop_assert_eq!(phase, WorkerPhase::Idle),
            Err(v) => {
                prop_assert_ne!(phase, WorkerPhase::Idle);
                prop_assert_eq!(v.call, None);
                prop_assert_eq!(p.handle(C::HandlePreemptions), Err(v), "the violation sticks");
            }
        }
        prop_assert_eq!(phase == WorkerPhase::Idle, matches!(prefix.last(), None | Some(Ev::Call(C::Clear))));
    }

    /// A single mutation of a legal run: the protocol and the grammar agree on where (and
    /// whether) it goes wrong; mutations that always break a run are rejected.
    #[test]
    fn mutated_sequences_are_judged_like_the_grammar(ev in legal_run(), m in mutation()) {
        if let Some(mutated) = m.apply(&ev) {
            let verdict = grammar(&mutated);
            prop_assert_eq!(run(&mutated)?, verdict, "mutated run {:?}", mutated);
            if m.always_illegal(&ev) {
                prop_assert_ne!(verdict, Verdict::Complete, "{:?} of {:?} is legal", m, ev);
            }
        }
    }
}

#[test]
fn the_grammar_catches_the_known_bugs_and_so_does_the_protocol() {
    let s = StepShape::default();
    let step = |calls: &[WorkerCall]| {
        let mut v = vec![Ev::Begin(s)];
        v.extend(calls.iter().copied().map(Ev::Call));
        v
    };
    // PR #42676: bind before handle_preemptions.
    let bind_first = step(&[C::Bind, C::HandlePreemptions]);
    // PR #20756: clear not the last call.
    let clear_early = step(&[
        C::HandlePreemptions,
        C::Bind,
        C::StartLoadKv,
        C::WaitForSave,
        C::GetFinished,
        C::Clear,
    ]);
    // Async loads start after the forward: no layer hook after start_load_kv.
    let layer_after_load = step(&[
        C::HandlePreemptions,
        C::Bind,
        C::StartLoadKv,
        C::WaitForLayerLoad,
    ]);
    for (ev, at) in [(bind_first, 1), (clear_early, 6), (layer_after_load, 4)] {
        assert_eq!(grammar(&ev), Verdict::Illegal(at), "{ev:?}");
        assert_eq!(run(&ev).unwrap(), Verdict::Illegal(at), "{ev:?}");
    }
    // Dropping the optional calls is legal.
    let minimal = step(&[
        C::HandlePreemptions,
        C::Bind,
        C::StartLoadKv,
        C::WaitForSave,
        C::GetFinished,
        C::GetBlockIdsWithLoadErrors,
        C::BuildWorkerMeta,
        C::Clear,
    ]);
    assert_eq!(run(&minimal).unwrap(), Verdict::Complete);
    assert_eq!(run(&minimal[..4]).unwrap(), Verdict::Unfinished);
}
