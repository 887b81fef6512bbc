//! [`Watch`]: what a rank may trust each GPU block for, so that a forward's reads cost nothing
//! once checked and every check is paid for by the bytes written.
//!
//! Bytes are checked where they change: a forward's writes right after it writes them, a load
//! when it lands (both in the rank task). A block's bytes change in no other way — so a request
//! that has checked a block of its prefix against its own tokens (the rank's shadow: the prefix
//! hash of every token slot) need not check it again while the block does not change, and a
//! decode step walks only the blocks its request has not checked yet. What makes that sound is
//! refusing every change to a block someone trusts:
//!
//! | hazard | what it is |
//! | --- | --- |
//! | a write into a block another request reads | a block reused while still in a table (freed too early, or held twice) |
//! | a write into a block a load is filling | a block reused while a transfer still writes it |
//! | a write into a block a store is reading | a block reused while a transfer still reads it (I-4) |
//! | a load into a block a request reads, or that another transfer uses | the same, seen from the load |
//! | a read of a block a load is filling | a request scheduled before its load landed |
//!
//! Call [`Watch::reset`] for the requests a step's output ends or replaces
//! (`kvrelay_core::tables_reset`) before the step begins; the rest as the forward and the
//! transfers happen.

use rustc_hash::FxHashMap as HashMap;

use kvrelay_core::{BlockAccess, BlockId, JobId, NULL_BLOCK, RequestId};

/// A change refused (see the module docs).
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum Hazard {
    /// A forward writes a block another request has read.
    WriteWhileRead { reader: Option<RequestId> },
    /// A forward writes a block a load is filling.
    WriteWhileLoading { job: JobId },
    /// A forward writes a block a store is reading.
    WriteWhileStoring,
    /// A load targets a block a request has read.
    LoadWhileRead { reader: Option<RequestId> },
    /// A load targets a block another transfer uses.
    LoadWhileTransferring,
    /// A store reads a block a load is filling.
    StoreWhileLoading { job: JobId },
    /// A forward reads a block a load is filling.
    ReadWhileLoading { job: JobId },
}

impl std::fmt::Display for Hazard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let who = |r: &Option<RequestId>| {
            r.map_or("a request".to_owned(), |r| format!("request {}", r.0))
        };
        match self {
            Self::WriteWhileRead { reader } => write!(f, "written while {} reads it", who(reader)),
            Self::WriteWhileLoading { job } => {
                write!(f, "written while load job {} fills it", job.0)
            }
            Self::WriteWhileStoring => write!(f, "written while a store reads it"),
            Self::LoadWhileRead { reader } => {
                write!(f, "loaded into while {} reads it", who(reader))
            }
            Self::LoadWhileTransferring => write!(f, "loaded into while another transfer uses it"),
            Self::StoreWhileLoading { job } => {
                write!(f, "stored while load job {} fills it", job.0)
            }
            Self::ReadWhileLoading { job } => write!(f, "read while load job {} fills it", job.0),
        }
    }
}

/// The blocks of one request's table (one group) it has checked: `blocks[i]` is table index
/// `i` (`NULL_BLOCK` where the table holds none); those below `low` left its window.
#[derive(Debug, Default)]
struct Checked {
    low: u32,
    blocks: Vec<BlockId>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Watch {
    /// Per GPU block: the requests whose checked prefix holds it.
    readers: Vec<u32>,
    /// Per GPU block: the load filling it.
    loading: Vec<Option<JobId>>,
    /// Per GPU block: stores reading it.
    storing: Vec<u32>,
    /// Per request, per group: what it checked.
    checked: HashMap<RequestId, Vec<Checked>>,
}

impl Watch {
    /// A rank of `gpu_blocks` blocks, nothing checked.
    pub fn new(gpu_blocks: u32) -> Self {
        let n = gpu_blocks as usize;
        Self {
            readers: vec![0; n],
            loading: vec![None; n],
            storing: vec![0; n],
            checked: HashMap::default(),
        }
    }

    /// `request`'s table ends or is replaced: it trusts nothing any more.
    pub fn reset(&mut self, request: RequestId) {
        for c in self.checked.remove(&request).into_iter().flatten() {
            for &b in &c.blocks[c.low as usize..] {
                self.release(b);
            }
        }
    }

    fn release(&mut self, b: BlockId) {
        if b == NULL_BLOCK {
            return;
        }
        if let Some(n) = self.readers.get_mut(b.0 as usize) {
            *n = n.saturating_sub(1);
        }
    }

    /// How far `request` has checked its table in `group`: the first table index it has not.
    pub fn checked_up_to(&self, request: RequestId, group: usize) -> u32 {
        self.checked
            .get(&request)
            .and_then(|g| g.get(group))
            .map_or(0, |c| c.blocks.len() as u32)
    }

    /// `request` reads from token `first_block` of its table on (a sliding window moved): the
    /// blocks before it are no longer trusted by it.
    pub fn window_from(&mut self, request: RequestId, group: usize, first_block: u32) {
        let Some(c) = self
            .checked
            .get_mut(&request)
            .and_then(|g| g.get_mut(group))
        else {
            return;
        };
        let to = first_block.min(c.blocks.len() as u32);
        let left: Vec<BlockId> = c.blocks[c.low.min(to) as usize..to as usize].to_vec();
        c.low = c.low.max(to);
        for b in left {
            self.release(b);
        }
    }

    /// Before a forward reads `a`, the next block of its request's table it has not checked:
    /// refused while a load fills it.
    pub fn may_read(&self, a: &BlockAccess) -> Result<(), Hazard> {
        match self.loading.get(a.block.0 as usize).copied().flatten() {
            Some(job) => Err(Hazard::ReadWhileLoading { job }),
            None => Ok(()),
        }
    }

    /// `a` was checked: its request trusts it from now on.
    pub fn trust(&mut self, a: &BlockAccess) {
        let groups = self.checked.entry(a.request).or_default();
        if groups.len() <= a.group {
            groups.resize_with(a.group + 1, Checked::default);
        }
        let c = &mut groups[a.group];
        while (c.blocks.len() as u32) < a.index {
            c.blocks.push(NULL_BLOCK);
        }
        if c.blocks.len() as u32 == a.index {
            c.blocks.push(a.block);
            if let Some(n) = self.readers.get_mut(a.block.0 as usize) {
                *n += 1;
            }
        }
    }

    /// Before a forward writes `a`.
    pub fn may_write(&self, a: &BlockAccess) -> Result<(), Hazard> {
        let i = a.block.0 as usize;
        if let Some(job) = self.loading.get(i).copied().flatten() {
            return Err(Hazard::WriteWhileLoading { job });
        }
        if self.storing.get(i).is_some_and(|&n| n > 0) {
            return Err(Hazard::WriteWhileStoring);
        }
        let own = self.trusts(a.request, a.group, a.index, a.block);
        if self.readers.get(i).is_some_and(|&n| n > u32::from(own)) {
            return Err(Hazard::WriteWhileRead {
                reader: self.reader_of(a.block, Some(a.request)),
            });
        }
        Ok(())
    }

    fn trusts(&self, request: RequestId, group: usize, index: u32, block: BlockId) -> bool {
        self.checked
            .get(&request)
            .and_then(|g| g.get(group))
            .is_some_and(|c| index >= c.low && c.blocks.get(index as usize) == Some(&block))
    }

    /// A request (other than `but`) that trusts `b`, for an error message.
    fn reader_of(&self, b: BlockId, but: Option<RequestId>) -> Option<RequestId> {
        let mut ids: Vec<RequestId> = self
            .checked
            .iter()
            .filter(|(r, g)| {
                Some(**r) != but && g.iter().any(|c| c.blocks[c.low as usize..].contains(&b))
            })
            .map(|(r, _)| *r)
            .collect();
        ids.sort();
        ids.first().copied()
    }

    /// A load `job` into `blocks` starts; refused with the first block it may not fill.
    pub fn start_load(&mut self, job: JobId, blocks: &[BlockId]) -> Result<(), (BlockId, Hazard)> {
        for &b in blocks {
            let i = b.0 as usize;
            if self.readers.get(i).is_some_and(|&n| n > 0) {
                let reader = self.reader_of(b, None);
                return Err((b, Hazard::LoadWhileRead { reader }));
            }
            if self.loading.get(i).copied().flatten().is_some()
                || self.storing.get(i).is_some_and(|&n| n > 0)
            {
                return Err((b, Hazard::LoadWhileTransferring));
            }
        }
        for b in blocks {
            if let Some(l) = self.loading.get_mut(b.0 as usize) {
                *l = Some(job);
            }
        }
        Ok(())
    }

    /// A load into `blocks` landed (or failed).
    pub fn end_load(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            if let Some(l) = self.loading.get_mut(b.0 as usize) {
                *l = None;
            }
        }
    }

    /// A store from `blocks` starts; refused with the first block a load is filling.
    pub fn start_store(&mut self, blocks: &[BlockId]) -> Result<(), (BlockId, Hazard)> {
        for &b in blocks {
            if let Some(job) = self.loading.get(b.0 as usize).copied().flatten() {
                return Err((b, Hazard::StoreWhileLoading { job }));
            }
        }
        for b in blocks {
            if let Some(n) = self.storing.get_mut(b.0 as usize) {
                *n += 1;
            }
        }
        Ok(())
    }

    /// A store from `blocks` completed (or failed).
    pub fn end_store(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            if let Some(n) = self.storing.get_mut(b.0 as usize) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(request: u32, index: u32, block: u64) -> BlockAccess {
        BlockAccess {
            request: RequestId(request),
            group: 0,
            index,
            block: BlockId(block),
            tokens: index * 4..index * 4 + 4,
        }
    }

    // Protects what makes skipping checked blocks sound: no change reaches a block someone
    // trusts, and a request whose table ends trusts nothing.
    #[test]
    fn a_trusted_block_cannot_change() {
        let mut w = Watch::new(8);
        w.trust(&access(1, 0, 3));
        w.trust(&access(1, 1, 4));
        assert_eq!(w.checked_up_to(RequestId(1), 0), 2);
        assert_eq!(w.may_write(&access(1, 1, 4)), Ok(()), "its own tail");
        assert_eq!(
            w.may_write(&access(2, 0, 4)),
            Err(Hazard::WriteWhileRead {
                reader: Some(RequestId(1))
            })
        );
        assert!(matches!(
            w.start_load(JobId(7), &[BlockId(5), BlockId(3)]),
            Err((BlockId(3), Hazard::LoadWhileRead { .. }))
        ));
        w.reset(RequestId(1));
        assert_eq!(w.may_write(&access(2, 0, 4)), Ok(()));
        assert_eq!(w.start_load(JobId(7), &[BlockId(3)]), Ok(()));
        assert_eq!(
            w.may_read(&access(2, 0, 3)),
            Err(Hazard::ReadWhileLoading { job: JobId(7) })
        );
        assert_eq!(
            w.may_write(&access(2, 0, 3)),
            Err(Hazard::WriteWhileLoading { job: JobId(7) })
        );
        w.end_load(&[BlockId(3)]);
        assert_eq!(w.may_read(&access(2, 0, 3)), Ok(()));
        w.start_store(&[BlockId(6)]).unwrap();
        assert_eq!(
            w.may_write(&access(3, 0, 6)),
            Err(Hazard::WriteWhileStoring)
        );
        w.end_store(&[BlockId(6)]);
        assert_eq!(w.may_write(&access(3, 0, 6)), Ok(()));
        // A window that moved past a block releases it.
        w.trust(&access(4, 0, 1));
        w.trust(&access(4, 1, 2));
        w.window_from(RequestId(4), 0, 1);
        assert_eq!(w.may_write(&access(5, 0, 1)), Ok(()));
        assert!(w.may_write(&access(5, 0, 2)).is_err());
    }
}
