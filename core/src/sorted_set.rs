//! [`SortedSet`]: the set type of every output and message (finished ids, invalid blocks).

use alloc::vec::Vec;

/// A set: its elements sorted ascending, without duplicates.
///
/// Sets are kept sorted so that equal sets are equal values (the model checker hashes states,
/// conformance compares results), and iteration order never depends on insertion order.
#[derive(Clone, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize)]
#[serde(transparent)]
pub struct SortedSet<T: Ord>(Vec<T>);

impl<T: Ord> SortedSet<T> {
    /// The empty set.
    pub const fn new() -> Self {
        Self(Vec::new())
    }

    /// The set of the elements of `items` (sorted and deduplicated here).
    pub fn from_vec(mut items: Vec<T>) -> Self {
        // Most sets arrive sorted already (a rank's set, or ids emitted in a sorted set's order).
        if !items.is_sorted() {
            items.sort_unstable();
        }
        items.dedup();
        Self(items)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `x` is an element.
    pub fn contains(&self, x: &T) -> bool {
        self.0.binary_search(x).is_ok()
    }

    /// The elements, ascending.
    pub fn as_slice(&self) -> &[T] {
        &self.0
    }

    /// The elements, ascending.
    pub fn iter(&self) -> core::slice::Iter<'_, T> {
        self.0.iter()
    }

    /// The elements, ascending.
    pub fn into_vec(self) -> Vec<T> {
        self.0
    }

    /// Removes `x`; returns whether it was there.
    pub fn remove(&mut self, x: &T) -> bool {
        match self.0.binary_search(x) {
            Ok(at) => {
                self.0.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    /// Adds `x`; returns whether it was new.
    pub fn insert(&mut self, x: T) -> bool {
        match self.0.binary_search(&x) {
            Ok(_) => false,
            Err(at) => {
                self.0.insert(at, x);
                true
            }
        }
    }
}

impl<T: Ord + Clone> SortedSet<T> {
    /// `self ∪ other`, in place (a linear merge).
    pub fn union_with(&mut self, other: &Self) {
        if other.0.is_empty() {
            return;
        }
        if self.0.is_empty() {
            self.0.clone_from(&other.0);
            return;
        }
        let mut out = Vec::with_capacity(self.0.len() + other.0.len());
        let (mut a, mut b) = (self.0.iter().peekable(), other.0.iter().peekable());
        loop {
            match (a.peek(), b.peek()) {
                (Some(x), Some(y)) => match x.cmp(y) {
                    core::cmp::Ordering::Less => out.push(a.next().unwrap().clone()),
                    core::cmp::Ordering::Greater => out.push(b.next().unwrap().clone()),
                    core::cmp::Ordering::Equal => {
                        out.push(a.next().unwrap().clone());
                        b.next();
                    }
                },
                (Some(_), None) => out.push(a.next().unwrap().clone()),
                (None, Some(_)) => out.push(b.next().unwrap().clone()),
                (None, None) => break,
            }
        }
        self.0 = out;
    }
}

impl<T: Ord> Default for SortedSet<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Ord> FromIterator<T> for SortedSet<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Self::from_vec(iter.into_iter().collect())
    }
}

impl<'a, T: Ord> IntoIterator for &'a SortedSet<T> {
    type Item = &'a T;
    type IntoIter = core::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<'de, T: Ord + serde::Deserialize<'de>> serde::Deserialize<'de> for SortedSet<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<T>::deserialize(d).map(Self::from_vec)
    }
}
