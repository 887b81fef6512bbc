//! Successors computed before the checker asks for them: [`remember`] and [`recall`].
//!
//! Choosing a partial-order reduction's ample set takes the candidate actions from the state
//! (to see that none breaks a property or loops), and the checker then asks `next_state` for
//! the actions it explores from that same state. A successor is a deterministic function of
//! the model, the state and the action, so the one computed for the choice is the one the
//! checker would compute: [`remember`] keeps it (per thread: each checker thread expands one
//! state at a time), [`recall`] hands it back once, when the model and the state are the same.
//!
//! Call `remember` only with a successor computed by the very `next_state` the checker calls,
//! from `source`; a state is recognised by equality, not by address, so a state equal to
//! `source` gets the same successors.
//!
//! [`derived`] keeps one value computed from a state, for the next state that agrees with it on
//! every part the value reads (the caller says which: its `same`); consecutive states of a
//! depth-first search often differ in one rank only.

use core::any::Any;
use core::cell::RefCell;

/// At most this many successors are kept (one state's expansion; a state of the system model
/// enables far fewer actions).
const BOUND: usize = 64;

struct Memo<S, A> {
    model: u64,
    source: S,
    next: Vec<(A, S)>,
}

thread_local! {
    static MEMO: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
    static DERIVED: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

struct Derived<S, V> {
    model: u64,
    source: S,
    value: V,
}

/// Keeps `next`, the successor of `source` by `action` in the model numbered `model`, for
/// [`recall`]. Forgets what was kept for any other model or state.
pub(crate) fn remember<S, A>(model: u64, source: &S, action: A, next: &S)
where
    S: Clone + PartialEq + 'static,
    A: PartialEq + 'static,
{
    MEMO.with_borrow_mut(|slot| {
        let fresh = match slot.as_mut().and_then(|b| b.downcast_mut::<Memo<S, A>>()) {
            Some(m) => m.model != model || m.source != *source,
            None => true,
        };
        if fresh {
            *slot = Some(Box::new(Memo::<S, A> {
                model,
                source: source.clone(),
                next: Vec::new(),
            }));
        }
        let Some(m) = slot.as_mut().and_then(|b| b.downcast_mut::<Memo<S, A>>()) else {
            return;
        };
        if m.next.len() < BOUND && !m.next.iter().any(|(a, _)| *a == action) {
            m.next.push((action, next.clone()));
        }
    });
}

/// The successor of `source` by `action` that [`remember`] kept for the model numbered
/// `model`, if any (each is handed back once).
pub(crate) fn recall<S, A>(model: u64, source: &S, action: &A) -> Option<S>
where
    S: PartialEq + 'static,
    A: PartialEq + 'static,
{
    MEMO.with_borrow_mut(|slot| {
        let m = slot.as_mut()?.downcast_mut::<Memo<S, A>>()?;
        if m.model != model || m.next.is_empty() || m.source != *source {
            return None;
        }
        let i = m.next.iter().position(|(a, _)| a == action)?;
        Some(m.next.swap_remove(i).1)
    })
}

/// `compute()`, or the value it gave for the last state `source` agrees with (`same`) in the
/// model numbered `model` (one value kept per thread and per `(S, V)` type). `same` must hold
/// only where `compute` reads nothing in which the two states differ.
pub(crate) fn derived<S, V>(
    model: u64,
    source: &S,
    same: impl Fn(&S, &S) -> bool,
    compute: impl FnOnce() -> V,
) -> V
where
    S: Clone + 'static,
    V: Clone + 'static,
{
    let kept = DERIVED.with_borrow(|slot| {
        let d = slot.as_ref()?.downcast_ref::<Derived<S, V>>()?;
        (d.model == model && same(&d.source, source)).then(|| d.value.clone())
    });
    if let Some(v) = kept {
        return v;
    }
    let value = compute();
    DERIVED.with_borrow_mut(|slot| {
        *slot = Some(Box::new(Derived::<S, V> {
            model,
            source: source.clone(),
            value: value.clone(),
        }));
    });
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept successor comes back once, for the same model and an equal state only.
    #[test]
    fn recalls_only_what_was_kept_for_that_state() {
        remember(1, &10u32, 'a', &11u32);
        remember(1, &10u32, 'b', &12u32);
        assert_eq!(recall(2, &10u32, &'a'), None, "another model");
        assert_eq!(recall(1, &9u32, &'a'), None, "another state");
        assert_eq!(recall(1, &10u32, &'c'), None, "another action");
        assert_eq!(recall(1, &10u32, &'a'), Some(11));
        assert_eq!(recall(1, &10u32, &'a'), None, "handed back once");
        remember(1, &20u32, 'b', &21u32);
        assert_eq!(
            recall(1, &10u32, &'b'),
            None,
            "a new state forgets the old one"
        );
        assert_eq!(recall(1, &20u32, &'b'), Some(21));
    }

    /// A derived value is reused for a state that agrees on what it reads, recomputed for
    /// another state or model.
    #[test]
    fn derived_values_follow_what_they_read() {
        let tens = |a: &u32, b: &u32| a / 10 == b / 10;
        let mut calls = 0;
        let mut get = |model: u64, s: u32| {
            derived(model, &s, tens, || {
                calls += 1;
                (s / 10) as u64
            })
        };
        assert_eq!(get(1, 12), 1);
        assert_eq!(get(1, 15), 1, "agrees on the tens: reused");
        assert_eq!(get(1, 25), 2);
        assert_eq!(get(2, 26), 2, "another model: recomputed");
        assert_eq!(calls, 3);
    }
}
