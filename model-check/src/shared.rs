//! [`Shared`]: a part of a model state that successor states share until one of them writes
//! it, with its hash computed once.
//!
//! A model checker clones a state for every successor it generates and hashes every state it
//! generates (its fingerprint), and most actions change one part of a state: one rank's worker,
//! or the engine. Holding each such part in a [`Shared`] makes a state's clone a few reference
//! counts, a write clone only the part it writes ([`Shared::make_mut`]), and a state's hash a
//! few 64-bit digests: each part is hashed once, when [`Shared::seal`] is called after the
//! action that wrote it.
//!
//! # Identity
//!
//! Two `Shared` values are equal when their contents are (the same allocation, or equal
//! values), and a `Shared` hashes as the 64-bit digest of its content (aHash with fixed seeds:
//! the same in every run), whether it was sealed or not — so equal contents hash alike, and a
//! state holding `Shared` parts keeps the identity it had with the parts inline, up to a
//! collision of 64-bit digests (the checker already identifies states by a 64-bit fingerprint).

use core::fmt;
use core::hash::{Hash, Hasher};
use core::ops::Deref;
use std::sync::Arc;

/// See the module docs.
pub struct Shared<T> {
    inner: Arc<T>,
    /// The digest of `inner`; `None` after a write, until [`Shared::seal`].
    digest: Option<u64>,
}

impl<T: Hash> Shared<T> {
    /// A sealed part holding `value`.
    pub fn new(value: T) -> Self {
        let digest = Some(digest_of(&value));
        Self {
            inner: Arc::new(value),
            digest,
        }
    }

    /// The content, for writing: cloned first if another state shares it. Call
    /// [`Shared::seal`] when the action is done.
    pub fn make_mut(&mut self) -> &mut T
    where
        T: Clone,
    {
        self.digest = None;
        Arc::make_mut(&mut self.inner)
    }

    /// Computes the digest of a part written since it was last sealed.
    pub fn seal(&mut self) {
        if self.digest.is_none() {
            self.digest = Some(digest_of(&*self.inner));
        }
    }

    /// The 64-bit digest of the content (computed now if the part was written and not sealed).
    pub fn digest(&self) -> u64 {
        self.digest.unwrap_or_else(|| digest_of(&*self.inner))
    }

    /// Whether `a` and `b` are the same allocation: neither was written since one was cloned
    /// from the other (so a property of the content checked on one holds for the other).
    pub fn same(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }
}

/// The digest: aHash with fixed seeds (the same in every run), the hasher stateright itself
/// fingerprints states with — fast on the many small writes a derived `Hash` makes.
fn digest_of<T: Hash>(value: &T) -> u64 {
    const SEEDS: (u64, u64, u64, u64) = (
        0x243f_6a88_85a3_08d3,
        0x1319_8a2e_0370_7344,
        0xa409_3822_299f_31d0,
        0x082e_fa98_ec4e_6c89,
    );
    ahash::RandomState::with_seeds(SEEDS.0, SEEDS.1, SEEDS.2, SEEDS.3).hash_one(value)
}

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            digest: self.digest,
        }
    }
}

impl<T> Deref for Shared<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: fmt::Debug> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl<T: PartialEq> PartialEq for Shared<T> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.digest.zip(other.digest).is_none_or(|(a, b)| a == b)
                && *self.inner == *other.inner)
    }
}

impl<T: Eq> Eq for Shared<T> {}

impl<T: Hash> Hash for Shared<T> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.digest());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_of<T: Hash>(v: &T) -> u64 {
        digest_of(v)
    }

    /// Identity: a written part is a new allocation, equal contents are equal and hash alike
    /// whether sealed or not, and a write changes the digest.
    #[test]
    fn identity_follows_the_content() {
        let a = Shared::new(vec![1u32, 2, 3]);
        let mut b = a.clone();
        assert!(Shared::same(&a, &b));
        b.make_mut().push(4);
        assert!(!Shared::same(&a, &b), "a write clones a shared part");
        assert_eq!(*a, vec![1, 2, 3], "the other state keeps its content");
        assert_ne!(a, b);
        let unsealed = hash_of(&b);
        b.seal();
        assert_eq!(hash_of(&b), unsealed, "sealing does not change the hash");
        b.make_mut().pop();
        assert_eq!(a, b, "equal contents in two allocations are equal");
        assert_eq!(hash_of(&a), hash_of(&b));
        b.seal();
        assert_eq!(a.digest(), b.digest());
    }
}
