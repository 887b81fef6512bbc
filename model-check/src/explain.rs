//! What a model must say about itself to be run, reported and drawn: the [`Explain`] trait.
//!
//! This module is the seam between the models and the runner. A model (`CompletionModel`,
//! `SystemModel`, or an engine's own) implements [`Explain`] next to its `stateright::Model`
//! impl; the runner (`check`, `check_with_symmetry`, `serve_explorer`) takes any `M: Explain`
//! and never names a model. Neither side imports the other: both depend on this module and on
//! the trace types ([`Arrow`]), so adding a model never touches the runner and changing the
//! runner never touches a model.
//!
//! Implement [`Explain::describe`] for the counterexample lines of a `CheckReport`, and
//! [`Explain::participants`] and [`Explain::arrow`] for its sequence diagrams (`mermaid`,
//! `CheckReport::mermaid`).

use std::fmt::Debug;
use std::hash::Hash;

use stateright::Model;

use crate::diagram::Arrow;

/// What the runner and `kvrelay check` need from a model beyond [`stateright::Model`]: readable
/// counterexample lines and the arrows of a sequence diagram.
///
/// The bounds on states and actions are what stateright's checkers and explorer need; they are
/// implied wherever `M: Explain` is.
pub trait Explain:
    Model<
        State: Clone + Debug + Hash + PartialEq + Send + Sync + 'static,
        Action: Clone + Debug + PartialEq + Send + Sync + 'static,
    > + Send
    + Sync
    + 'static
{
    /// `action` taken in `state`: one readable line naming the action and the state change that
    /// matters (what a rank reported, what the aggregator emitted, which error a call returned).
    fn describe(&self, state: &Self::State, action: &Self::Action) -> String;

    /// The participants of the model's sequence diagrams, left to right (e.g. `"scheduler"`,
    /// `"rank 0"`, `"rank 1"`, `"aggregator"`, `"env"`). [`Arrow::from`] and
    /// [`Arrow::to`] index this list.
    fn participants(&self) -> Vec<String>;

    /// `action` taken in `state` as one arrow of a sequence diagram: who acts, on whom, with
    /// what label, and an optional note (an error, a fault, a violation).
    fn arrow(&self, state: &Self::State, action: &Self::Action) -> Arrow;
}
