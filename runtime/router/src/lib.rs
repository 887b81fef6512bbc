//! kvrelay-router: a KV-aware router, the consumer of the KV events engines publish in vLLM
//! 0.33.0's wire format (`kvrelay run --kv-events`, or vLLM's own `ZmqEventPublisher`). It
//! follows each engine's stream, keeps what each engine holds, and sends each request to the
//! engine holding its longest cached prefix, load breaking ties — what llm-d's and Dynamo's
//! routers do. `kvrelay route` runs it over engines of one process on a workload, against round
//! robin (`docs/ROUTING.md`).
//!
//! | room | what |
//! | --- | --- |
//! | [`decode`] | a `KVEventBatch` frame, validated ([`decode_batch`]) |
//! | [`subscriber`] | one engine's stream, gap-free (SUB, and replay for what the SUB missed) |
//! | [`index`] | what one engine holds, and a prompt's longest cached prefix there |
//! | [`mod@route`] | the routed replay over N engines ([`route()`]), its [`RouteReport`] |
//!
//! To route for engines of your own, keep one [`Subscriber`] and one [`PrefixIndex`] per
//! engine, apply every synced batch to its index, and score a prompt by walking its vLLM hash
//! chain (`kvrelay_engine::events::vllm_hash`) through the indexes.

pub mod decode;
pub mod index;
pub mod route;
pub mod subscriber;

pub use self::decode::{Batch, DecodeError, decode_batch};
pub use self::index::PrefixIndex;
pub use self::route::{Policy, RouteError, RouteReport, Share, route};
pub use self::subscriber::{StreamError, Subscriber};
