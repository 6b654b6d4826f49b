//! W3C trace context and span recording on the shards.
//!
//! The request parser reads the client's `traceparent` into the [`RequestHead`];
//! [`begin`] decides whether this request is recorded (an OTLP endpoint is
//! configured, the client's sampled flag, `traces.sample_ratio`) and gives it the
//! gateway's own request span. Shards then fill fixed-size [`SpanRecord`]s (no heap
//! allocation, no prompt text, no credentials) for the request, each routing decision,
//! each upstream attempt, each prefill and decode leg of a split request and each
//! workflow node, and hand them to the `radixgate-otlp` thread over a bounded
//! lock-free channel ([`crate::otlp`] batches and exports them); a full channel drops
//! the span rather than wait. Upstream, the span of the attempt, leg or node becomes
//! the engine's parent in the `traceparent` it sends, so engine traces join.

use crate::access_log::AccessRecord;
use crate::http::request::RequestHead;
use crate::otlp::{SpanKind, SpanRecord};
use crate::shard::Shard;
use std::time::Instant;

/// Spans buffered between the shards and the exporter; past this, spans are dropped.
pub const CHANNEL_CAPACITY: usize = 16 << 10;

/// A request's trace context, copied out of its head for work that outlives the
/// head's borrow (a workflow node's task, an SGLang prefill leg's task).
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContext {
    /// 0: the request has no trace.
    pub trace_id: u128,
    /// The gateway's request span; 0 when the request is not recorded.
    pub span_id: u64,
    /// The client's parent span (0 for a trace the gateway started).
    pub parent_span_id: u64,
    pub flags: u8,
}

impl TraceContext {
    pub fn of(head: &RequestHead) -> Self {
        Self {
            trace_id: head.trace_id,
            span_id: head.span_id,
            parent_span_id: head.parent_span_id,
            flags: head.trace_flags,
        }
    }
}

/// A child span of the request span in progress (see [`start_child`]).
#[derive(Debug, Clone, Copy)]
pub struct ChildSpan {
    trace_id: u128,
    parent_id: u64,
    pub span_id: u64,
    start: Instant,
}

/// The span id a child's upstream `traceparent` names (0: none recorded).
pub fn id_of(span: Option<ChildSpan>) -> u64 {
    span.map_or(0, |s| s.span_id)
}

/// A fresh non-zero span id (the thread's fastrand generator, seeded per process:
/// ids must not repeat across restarts, unlike the shard's seeded routing RNG).
fn span_id() -> u64 {
    fastrand::u64(1..)
}

/// Gives the request its trace context: the gateway's request span when the request
/// is recorded (exporter on, and the client's sampled flag or, for a new trace,
/// `traces.sample_ratio`), and a new trace id when the client sent none. Without an
/// exporter the client's context passes through unchanged.
pub fn begin(shard: &Shard, head: &mut RequestHead) {
    head.span_id = 0;
    let Some(cfg) = &shard.shared.config.traces else {
        return;
    };
    if shard.shared.spans.is_none() {
        return;
    }
    let recorded = if head.trace_id != 0 {
        head.trace_flags & 1 == 1
    } else {
        let sampled = cfg.sample_ratio >= 1.0 || fastrand::f64() < cfg.sample_ratio;
        if sampled {
            head.trace_id = fastrand::u128(1..);
            head.trace_flags = 1;
        }
        sampled
    };
    if recorded {
        head.span_id = span_id();
    }
}

/// A child span of the request span starts, when the request is recorded (no clock
/// read otherwise).
pub fn start_child(cx: &TraceContext) -> Option<ChildSpan> {
    (cx.span_id != 0).then(|| ChildSpan {
        trace_id: cx.trace_id,
        parent_id: cx.span_id,
        span_id: span_id(),
        start: Instant::now(),
    })
}

/// Appends `traceparent: 00-<trace>-<span>-<flags>\r\n` when the request has a trace:
/// `span` (the attempt's, leg's or node's) as parent when recorded, else the client's
/// own parent.
pub fn write_traceparent(out: &mut Vec<u8>, cx: &TraceContext, span: u64) {
    if cx.trace_id == 0 {
        return;
    }
    let parent = if span != 0 { span } else { cx.parent_span_id };
    out.extend_from_slice(b"traceparent: 00-");
    push_hex(out, cx.trace_id, 32);
    out.push(b'-');
    push_hex(out, parent as u128, 16);
    out.push(b'-');
    push_hex(out, cx.flags as u128, 2);
    out.extend_from_slice(b"\r\n");
}

/// Appends the low `digits` hex digits of `n`, lowercase (no `core::fmt`).
pub fn push_hex(out: &mut Vec<u8>, n: u128, digits: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        out.push(HEX[((n >> (4 * i)) & 0xf) as usize]);
    }
}

/// Hands a span to the exporter; drops it when the channel is full.
pub fn emit(shard: &Shard, span: SpanRecord) {
    if let Some(tx) = &shard.shared.spans {
        if tx.try_send(span).is_err() {
            // Only when the exporter falls behind: one relaxed add on the drop path.
            let dropped = &shard.shared.span_counters.dropped;
            dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// A finished child span of the request (from [`start_child`]), to fill in.
pub fn child(shard: &Shard, kind: SpanKind, started: Option<ChildSpan>) -> Option<SpanRecord> {
    let ChildSpan {
        trace_id,
        parent_id,
        span_id,
        start,
    } = started?;
    Some(SpanRecord {
        kind,
        trace_id,
        span_id,
        parent_id,
        start,
        end: Instant::now(),
        shard: shard.id,
        backend: None,
        model: None,
        tenant: None,
        status: 0,
        reason: "",
        policy: "",
        attempt: 0,
        matched_blocks: 0,
        id: None,
    })
}

/// The request span, from the request's access record.
pub fn finish_request(shard: &Shard, head: &RequestHead, started: Instant, r: &AccessRecord) {
    if head.span_id == 0 {
        return;
    }
    emit(
        shard,
        SpanRecord {
            kind: SpanKind::Request,
            trace_id: head.trace_id,
            span_id: head.span_id,
            parent_id: head.parent_span_id,
            start: started,
            end: Instant::now(),
            shard: shard.id,
            backend: r.backend,
            model: r.model,
            tenant: r.tenant,
            status: r.status,
            reason: r.reason,
            policy: r.policy,
            attempt: r.retries,
            matched_blocks: r.matched_blocks,
            id: Some(r.request_id),
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_only_of_a_recorded_request_span() {
        let unrecorded = TraceContext {
            trace_id: 7,
            span_id: 0,
            parent_span_id: 3,
            flags: 0,
        };
        assert!(start_child(&unrecorded).is_none());
        assert_eq!(id_of(None), 0);
        let recorded = TraceContext {
            span_id: 9,
            flags: 1,
            ..unrecorded
        };
        let child = start_child(&recorded).unwrap();
        assert_eq!((child.trace_id, child.parent_id), (7, 9));
        assert!(child.span_id != 0 && child.span_id != 9);
        assert_eq!(id_of(Some(child)), child.span_id);
    }

    #[test]
    fn writes_traceparent_with_the_attempt_span() {
        let head = TraceContext::of(&RequestHead {
            trace_id: 0x4bf92f3577b34da6a3ce929d0e0e4736,
            parent_span_id: 0x00f067aa0ba902b7,
            trace_flags: 1,
            ..Default::default()
        });
        let mut out = Vec::new();
        write_traceparent(&mut out, &head, 0xabc);
        assert_eq!(
            out,
            b"traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000abc-01\r\n"
        );
        out.clear();
        write_traceparent(&mut out, &head, 0);
        assert_eq!(
            out,
            b"traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n"
        );
        out.clear();
        write_traceparent(&mut out, &TraceContext::default(), 7);
        assert!(out.is_empty());
    }
}
