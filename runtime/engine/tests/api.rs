//! The embedding API: requests submitted from tasks stream their tokens and finish; an abort
//! ends a stream; a dropped stream aborts its request; ids are reused once released.

use kvrelay_core::FinishReason;
use kvrelay_engine::RunConfig;
use kvrelay_engine::api::{EngineHandle, RequestEvent, RequestStream};

async fn collect(mut s: RequestStream) -> (usize, Option<FinishReason>) {
    let mut tokens = 0;
    while let Some(e) = s.recv().await {
        match e {
            RequestEvent::Tokens(t) => tokens += t.len(),
            RequestEvent::Finished(r) => return (tokens, Some(r)),
            RequestEvent::Failed(why) => panic!("the engine stopped: {why}"),
        }
    }
    (tokens, None)
}

fn config() -> RunConfig {
    RunConfig {
        check: true,
        ..RunConfig::default()
    }
}

// Protects the API's contract: every submitted request streams exactly max_tokens tokens, then
// one finish; shared prompts hit the prefix cache without changing what is streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitted_requests_stream_their_tokens_then_finish() {
    let h = EngineHandle::spawn(config(), 4096).await.unwrap();
    let shared: Vec<u32> = (0..200).collect();
    let mut streams = Vec::new();
    for i in 0..6u32 {
        let mut prompt = shared.clone();
        prompt.extend([1000 + i; 20]);
        let (_, s) = h.submit(prompt, 10 + i).await.unwrap();
        streams.push((10 + i, s));
    }
    for (want, s) in streams {
        let (n, finish) = collect(s).await;
        assert_eq!(n, want as usize);
        assert_eq!(finish, Some(FinishReason::LengthCapped));
    }
    h.shutdown().await.unwrap();
}

// Protects abort and the dropped-stream rule: an aborted request's stream ends with Aborted; a
// request whose stream is dropped stops being served; the engine then drains and shuts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_and_dropped_streams_end_requests() {
    let h = EngineHandle::spawn(config(), 8192).await.unwrap();
    let (id, s) = h.submit((0..64).collect(), 2_000).await.unwrap();
    let (_, dropped) = h.submit((100..164).collect(), 2_000).await.unwrap();
    drop(dropped);
    assert!(h.abort(id).await.unwrap());
    let (_, finish) = collect(s).await;
    assert_eq!(finish, Some(FinishReason::Aborted));
    assert!(!h.abort(id).await.unwrap(), "not live any more");
    let _ = h.reset_cache().await.unwrap();
    // Ids come back once released: many short requests in a row do not exhaust them.
    for _ in 0..20 {
        let (_, s) = h.submit((0..8).collect(), 1).await.unwrap();
        assert_eq!(collect(s).await.0, 1);
    }
    h.shutdown().await.unwrap();
}

// Protects the embedding API's metrics (issue 38): served on the address bound while the
// engine runs, the engine side's counters current after each step; gone after shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_are_served_while_the_engine_runs() {
    use std::io::{Read, Write};
    let c = RunConfig {
        metrics: Some("127.0.0.1:0".into()),
        ..config()
    };
    let h = EngineHandle::spawn(c, 4096).await.unwrap();
    let addr = h.metrics_addr().expect("served");
    let (_, s) = h.submit((0..100).collect(), 7).await.unwrap();
    assert_eq!(collect(s).await.0, 7);
    let body = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
    .await
    .unwrap();
    let line = "vllm:generation_tokens_total{model_name=\"kvrelay\",engine=\"0\"} 7";
    assert!(body.lines().any(|l| l == line), "{body}");
    h.shutdown().await.unwrap();
    assert!(std::net::TcpStream::connect(addr).is_err(), "still served");
}
