//! RESP2, as far as the tier speaks it: commands framed as arrays of bulk strings, replies
//! parsed with every length checked before it is trusted (a node is another process: what it
//! sends is validated as it is decoded), and Redis Cluster's key slots.

use std::ops::Range;

use bytes::{Bytes, BytesMut};

/// Redis Cluster's hash slots.
pub(crate) const SLOTS: usize = 16_384;

/// The longest bulk string accepted (Redis's own `proto-max-bulk-len` default).
const MAX_BULK: usize = 512 << 20;

/// The most elements an array reply may have.
const MAX_ARRAY: usize = 1 << 20;

/// The longest status, error or length line accepted.
const MAX_LINE: usize = 64 << 10;

/// A reply. A bulk string is a view of the read buffer (`B`: [`Bytes`]), never a copy; while a
/// reply is parsed, its bulk strings are ranges of the buffer (`B`: `Range<usize>`), so a reply
/// that has not all arrived costs no copy.
#[derive(Clone, Debug, Eq, PartialEq)]
pub(crate) enum Reply<B = Bytes> {
    /// `+OK` and the like.
    Simple(String),
    /// `-ERR …`, `-MOVED …`.
    Error(String),
    Int(i64),
    /// `None`: the nil bulk string (an absent key).
    Bulk(Option<B>),
    /// An array (the nil array as an empty one).
    Array(Vec<Reply<B>>),
}

impl Reply {
    /// A redirection: the slot map is stale.
    pub(crate) fn is_redirect(&self) -> bool {
        matches!(self, Self::Error(e) if e.starts_with("MOVED ") || e.starts_with("ASK "))
    }
}

impl Reply<Range<usize>> {
    /// The reply with its bulk strings cut from `frame` (the buffer the ranges index).
    fn cut(self, frame: &Bytes) -> Reply {
        match self {
            Self::Simple(s) => Reply::Simple(s),
            Self::Error(e) => Reply::Error(e),
            Self::Int(n) => Reply::Int(n),
            Self::Bulk(r) => Reply::Bulk(r.map(|r| frame.slice(r))),
            Self::Array(items) => Reply::Array(items.into_iter().map(|i| i.cut(frame)).collect()),
        }
    }
}

/// A command to frame: a name and its keys, or its key-value pairs (the values moved into the
/// frame, never copied).
pub(crate) enum Command<'a> {
    Keys(&'static str, &'a [String]),
    Pairs(&'static str, Vec<(String, Vec<u8>)>),
}

impl<'a> Command<'a> {
    pub(crate) fn keys(name: &'static str, keys: &'a [String]) -> Self {
        Self::Keys(name, keys)
    }

    pub(crate) fn pairs(name: &'static str, pairs: Vec<(String, Vec<u8>)>) -> Self {
        Self::Pairs(name, pairs)
    }

    /// Its first key: the one that routes it (every key of a command shares its slot).
    pub(crate) fn first_key(&self) -> Option<&str> {
        match self {
            Self::Keys(_, keys) => keys.first().map(String::as_str),
            Self::Pairs(_, pairs) => pairs.first().map(|(k, _)| k.as_str()),
        }
    }

    /// Appends its frame to `out`.
    pub(crate) fn write(self, out: &mut Frames) {
        match self {
            Self::Keys(name, keys) => {
                header(&mut out.open, b'*', 1 + keys.len());
                bulk(&mut out.open, name.as_bytes());
                keys.iter().for_each(|k| bulk(&mut out.open, k.as_bytes()));
            }
            Self::Pairs(name, pairs) => {
                header(&mut out.open, b'*', 1 + 2 * pairs.len());
                bulk(&mut out.open, name.as_bytes());
                for (k, v) in pairs {
                    bulk(&mut out.open, k.as_bytes());
                    header(&mut out.open, b'$', v.len());
                    out.value(v);
                    out.open.extend_from_slice(b"\r\n");
                }
            }
        }
    }
}

/// Values from this size on are segments of their own in [`Frames`] (smaller ones are copied).
const OWN_SEGMENT: usize = 4 << 10;

/// Framed commands for one connection, as segments for one vectored write: the framing copied
/// together, each large value (a chunk's shard) a segment of its own, moved in.
#[derive(Default)]
pub(crate) struct Frames {
    segments: Vec<Vec<u8>>,
    open: Vec<u8>,
}

impl Frames {
    fn value(&mut self, v: Vec<u8>) {
        if v.len() < OWN_SEGMENT {
            return self.open.extend_from_slice(&v);
        }
        if !self.open.is_empty() {
            self.segments.push(std::mem::take(&mut self.open));
        }
        self.segments.push(v);
    }

    /// The segments, in the order they go on the wire.
    pub(crate) fn into_segments(mut self) -> Vec<Vec<u8>> {
        if !self.open.is_empty() {
            self.segments.push(self.open);
        }
        self.segments
    }
}

fn header(buf: &mut Vec<u8>, kind: u8, n: usize) {
    buf.push(kind);
    buf.extend_from_slice(n.to_string().as_bytes());
    buf.extend_from_slice(b"\r\n");
}

fn bulk(buf: &mut Vec<u8>, b: &[u8]) {
    header(buf, b'$', b.len());
    buf.extend_from_slice(b);
    buf.extend_from_slice(b"\r\n");
}

/// Takes the first whole reply off `buf`: `None` until all of it has arrived; `Err` when what
/// arrived is not RESP, or a length is past the limits. Its bulk strings share `buf`'s memory.
pub(crate) fn parse(buf: &mut BytesMut) -> Result<Option<Reply>, String> {
    match parse_at(buf, 0)? {
        Some((reply, end)) => Ok(Some(reply.cut(&buf.split_to(end).freeze()))),
        None => Ok(None),
    }
}

/// A reply being parsed (bulk strings as ranges of the buffer) and where the next one starts.
type Parsed = (Reply<Range<usize>>, usize);

fn parse_at(b: &[u8], at: usize) -> Result<Option<Parsed>, String> {
    let Some((kind, line, next)) = line(b, at)? else {
        return Ok(None);
    };
    let text = || String::from_utf8_lossy(line).into_owned();
    match kind {
        b'+' => Ok(Some((Reply::Simple(text()), next))),
        b'-' => Ok(Some((Reply::Error(text()), next))),
        b':' => Ok(Some((Reply::Int(number(line)?), next))),
        b'$' => {
            let n = number(line)?;
            if n < 0 {
                return Ok(Some((Reply::Bulk(None), next)));
            }
            let n = usize::try_from(n).ok().filter(|&n| n <= MAX_BULK);
            let n = n.ok_or_else(|| format!("a bulk string of {} bytes", text()))?;
            if b.len() < next + n + 2 {
                return Ok(None);
            }
            if &b[next + n..next + n + 2] != b"\r\n" {
                return Err("a bulk string not ended by CRLF".into());
            }
            Ok(Some((Reply::Bulk(Some(next..next + n)), next + n + 2)))
        }
        b'*' => {
            let n = number(line)?;
            let n = if n < 0 { 0 } else { n as usize };
            if n > MAX_ARRAY {
                return Err(format!("an array of {n} elements"));
            }
            let mut items = Vec::with_capacity(n.min(1024));
            let mut at = next;
            for _ in 0..n {
                let Some((item, end)) = parse_at(b, at)? else {
                    return Ok(None);
                };
                items.push(item);
                at = end;
            }
            Ok(Some((Reply::Array(items), at)))
        }
        other => Err(format!("a reply of type {:?}", char::from(other))),
    }
}

/// A line of a reply: its type byte, the rest of it, and where the next line starts.
type Line<'a> = (u8, &'a [u8], usize);

/// The line at `at` (`None`: not all of it has arrived).
fn line(b: &[u8], at: usize) -> Result<Option<Line<'_>>, String> {
    let rest = &b[at.min(b.len())..];
    let window = &rest[..rest.len().min(MAX_LINE)];
    match window.windows(2).position(|w| w == b"\r\n") {
        Some(0) => Err("an empty line".into()),
        Some(end) => Ok(Some((rest[0], &rest[1..end], at + end + 2))),
        None if rest.len() > MAX_LINE => Err(format!("a line longer than {MAX_LINE} bytes")),
        None => Ok(None),
    }
}

fn number(line: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{:?} is not a number", String::from_utf8_lossy(line)))
}

/// The slot of `key`: CRC16 (XMODEM) of its hash tag (between the first `{` and the next `}`,
/// when not empty), else of the whole key; as Redis Cluster computes it.
pub(crate) fn key_slot(key: &str) -> usize {
    let k = key.as_bytes();
    let tagged = k.iter().position(|&c| c == b'{').and_then(|open| {
        let close = k[open + 1..].iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &k[open + 1..open + 1 + close])
    });
    usize::from(crc16(tagged.unwrap_or(k))) % SLOTS
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// `CLUSTER SLOTS`' answer as (first slot, last slot, master's `HOST:PORT`); a master listed
/// without a host is `asked`'s host.
pub(crate) fn slot_ranges(reply: &Reply, asked: &str) -> Result<Vec<(u16, u16, String)>, String> {
    let bad = || format!("CLUSTER SLOTS: unexpected reply {reply:?}");
    let Reply::Array(ranges) = reply else {
        return Err(match reply {
            Reply::Error(e) => format!("CLUSTER SLOTS: {e}"),
            _ => bad(),
        });
    };
    let asked_host = asked.rsplit_once(':').map_or(asked, |(h, _)| h);
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        let Reply::Array(f) = r else {
            return Err(bad());
        };
        let (Some(Reply::Int(from)), Some(Reply::Int(to)), Some(Reply::Array(master))) =
            (f.first(), f.get(1), f.get(2))
        else {
            return Err(bad());
        };
        let (Some(Reply::Bulk(Some(host))), Some(Reply::Int(port))) =
            (master.first(), master.get(1))
        else {
            return Err(bad());
        };
        let slot = |s: i64| u16::try_from(s).ok().filter(|&s| usize::from(s) < SLOTS);
        let (Some(from), Some(to), Ok(port)) = (slot(*from), slot(*to), u16::try_from(*port))
        else {
            return Err(bad());
        };
        if from > to {
            return Err(bad());
        }
        let host = String::from_utf8_lossy(host);
        let host = if host.is_empty() { asked_host } else { &host };
        out.push((from, to, format!("{host}:{port}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(bytes: &[u8]) -> Result<Option<Reply>, String> {
        parse(&mut BytesMut::from(bytes))
    }

    // Protects the framing of values (binary, CRLF inside) and the parsing of every reply the
    // tier meets, whole or cut anywhere.
    #[test]
    fn commands_frame_and_replies_parse_whole_or_in_pieces() {
        let big = vec![7u8; OWN_SEGMENT];
        let pairs = vec![
            ("k{a}".to_owned(), b"v\r\n\0".to_vec()),
            ("l{a}".to_owned(), big.clone()),
        ];
        let mut frames = Frames::default();
        Command::pairs("MSET", pairs).write(&mut frames);
        let segments = frames.into_segments();
        // The large value is moved in whole, between the framing around it.
        assert_eq!(segments.len(), 3);
        assert_eq!(segments[1], big);
        let mut want = b"*5\r\n$4\r\nMSET\r\n$4\r\nk{a}\r\n$4\r\nv\r\n\0\r\n".to_vec();
        want.extend_from_slice(format!("$4\r\nl{{a}}\r\n${}\r\n", big.len()).as_bytes());
        want.extend_from_slice(&big);
        want.extend_from_slice(b"\r\n");
        assert_eq!(segments.concat(), want);
        let reply = b"*3\r\n$4\r\nv\r\n\0\r\n$-1\r\n$0\r\n\r\n";
        let want = Reply::Array(vec![
            Reply::Bulk(Some(Bytes::from_static(b"v\r\n\0"))),
            Reply::Bulk(None),
            Reply::Bulk(Some(Bytes::new())),
        ]);
        assert_eq!(parsed(reply), Ok(Some(want)));
        for cut in 0..reply.len() {
            assert_eq!(parsed(&reply[..cut]), Ok(None), "cut at {cut}");
        }
        let mut two = BytesMut::from(&b"+OK\r\n:2\r\n-MOVED 3999 127.0.0.1:7002\r\n"[..]);
        assert_eq!(parse(&mut two), Ok(Some(Reply::Simple("OK".into()))));
        assert_eq!(parse(&mut two), Ok(Some(Reply::Int(2))));
        assert!(parse(&mut two).unwrap().unwrap().is_redirect());
        assert!(two.is_empty());
    }

    // Protects against a node (or anything on its port) that sends what is not RESP: a typed
    // error, never a panic or an allocation of the length it claims.
    #[test]
    fn garbage_and_huge_lengths_are_errors() {
        for bad in [
            &b"?x\r\n"[..],
            b"$abc\r\n",
            b"$99999999999\r\n",
            b"*99999999999\r\n",
            b"$1\r\nxyz",
            b"\r\n",
        ] {
            assert!(parsed(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(parsed(&vec![b'+'; MAX_LINE + 10]).is_err());
    }

    // Protects routing: Redis Cluster's own slots (its documentation's examples and hash
    // tags), so each chunk's command reaches the node that owns it.
    #[test]
    fn key_slots_are_redis_clusters() {
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("foo{}{bar}"), key_slot("foo{}{bar}"));
        assert_ne!(key_slot("foo{}{bar}"), key_slot("bar"));
        assert_eq!(key_slot("foo{{bar}}zap"), key_slot("{bar"));
    }

    // Protects the slot map: ranges and masters from CLUSTER SLOTS, an empty host meaning
    // the node asked, and a malformed answer refused.
    #[test]
    fn cluster_slots_become_ranges() {
        let node = |h: &'static str, p| {
            Reply::Array(vec![Reply::Bulk(Some(Bytes::from(h))), Reply::Int(p)])
        };
        let reply = Reply::Array(vec![
            Reply::Array(vec![
                Reply::Int(0),
                Reply::Int(5460),
                node("10.0.0.1", 7000),
            ]),
            Reply::Array(vec![
                Reply::Int(5461),
                Reply::Int(16383),
                node("", 7001),
                node("x", 1),
            ]),
        ]);
        let want = vec![
            (0, 5460, "10.0.0.1:7000".to_owned()),
            (5461, 16383, "127.0.0.1:7001".to_owned()),
        ];
        assert_eq!(slot_ranges(&reply, "127.0.0.1:7000"), Ok(want));
        let bad = Reply::Array(vec![Reply::Array(vec![
            Reply::Int(9),
            Reply::Int(20000),
            node("h", 1),
        ])]);
        assert!(slot_ranges(&bad, "h:1").is_err());
        assert!(slot_ranges(&Reply::Error("ERR cluster support disabled".into()), "h:1").is_err());
    }
}
