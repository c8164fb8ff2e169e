//! The answers: a whole response object, or a stream of server-sent events, in the shape of
//! each endpoint (completions, chat, Responses, Messages), with `usage` as vLLM reports it.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use kvgate_shared::prompt::openai::{Endpoint, ParsedRequest};
use serde_json::{json, Value};

use crate::engine::{Ending, Produced, Submitted};
use crate::fanout::{Fanout, Gathered, Usage};

use super::transfer::{transfer_failure, Origin};
use super::{tagged, unix_now, AppState};

/// A Responses API `response` object as vLLM writes it: `text` is the finished output (none
/// while in progress), `usage` is set once it is done. Output always stops at the limit, so a
/// finished response is `incomplete` for `max_output_tokens`, as vLLM reports it.
pub(super) fn response_object(
    id: &str,
    model: &str,
    max_tokens: u32,
    text: Option<&str>,
    usage: Option<&Usage>,
) -> Value {
    let output = match text {
        Some(text) => json!([{"id": format!("msg_{id}"), "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": null}]}]),
        None => json!([]),
    };
    let (status, incomplete) = match usage {
        Some(_) => ("incomplete", json!({"reason": "max_output_tokens"})),
        None => ("in_progress", Value::Null),
    };
    json!({"id": id, "created_at": unix_now(), "incomplete_details": incomplete, "instructions": null,
        "metadata": null, "model": model, "object": "response", "output": output, "parallel_tool_calls": true,
        "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0, "background": false,
        "max_output_tokens": max_tokens, "status": status, "truncation": "disabled",
        "usage": usage.map(Usage::responses_json)})
}

/// A streamed Responses request, with the events vLLM sends for a text answer: the response
/// created and in progress, its message and text part opened, one `response.output_text.delta`
/// per token, then everything closed and `response.completed` carrying `usage`.
pub(super) fn stream_response(
    state: Arc<AppState>,
    request: ParsedRequest,
    id: String,
    prompt_len: usize,
    max_tokens: u32,
    mut tokens_rx: tokio::sync::mpsc::UnboundedReceiver<Produced>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let worker = state.clone();
    tokio::spawn(async move {
        let item_id = format!("msg_{id}");
        let mut sequence = 0u64;
        let mut event = |kind: &str, mut data: Value| -> Bytes {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(sequence);
            sequence += 1;
            Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
        };
        let in_progress = response_object(&id, request.model.as_str(), max_tokens, None, None);
        let message =
            json!({"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []});
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let opening = [
            event("response.created", json!({"response": in_progress})),
            event("response.in_progress", json!({"response": in_progress})),
            event("response.output_item.added", json!({"output_index": 0, "item": message})),
            event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
            ),
        ];
        for bytes in opening {
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
        let mut usage = Usage { prompt: prompt_len, completion: 0, cached: 0, details: true };
        let mut text = String::new();
        while let Some(Produced { emitted: e, .. }) = tokens_rx.recv().await {
            usage.completion = e.index;
            usage.cached = e.cached_tokens;
            let delta = worker.tokenizer.decode(&[e.token]).unwrap_or_default();
            text.push_str(&delta);
            let data =
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": delta, "logprobs": []});
            if tx.send(event("response.output_text.delta", data)).await.is_err() {
                return;
            }
            if e.finished {
                break;
            }
        }
        let done = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": null});
        let closing = [
            event(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            ),
            event(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": done}),
            ),
            event(
                "response.output_item.done",
                json!({"output_index": 0, "item": {"id": item_id, "type": "message",
                "role": "assistant", "status": "completed", "content": [done]}}),
            ),
            event(
                "response.completed",
                json!({"response": response_object(&id, request.model.as_str(), max_tokens, Some(&text), Some(&usage))}),
            ),
        ];
        for bytes in closing {
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
    });
    sse(&state, rx)
}

/// An Anthropic `message` object as vLLM writes it (`messages_full_converter`): output always
/// stops at the limit, so `stop_reason` is `max_tokens`.
pub(super) fn message_object(id: &str, model: &str, text: &str, usage: &Usage) -> Value {
    json!({"id": id, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
        "model": model, "stop_reason": "max_tokens", "stop_sequence": null, "usage": usage.anthropic_json()})
}

/// A streamed Messages request, with the events vLLM sends for a text answer
/// (`message_stream_converter`): `message_start`, a text block opened, one
/// `content_block_delta` per token, the block closed, `message_delta` carrying the stop reason
/// and `usage`, then `message_stop`.
pub(super) fn stream_message(
    state: Arc<AppState>,
    request: ParsedRequest,
    id: String,
    prompt_len: usize,
    mut tokens_rx: tokio::sync::mpsc::UnboundedReceiver<Produced>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let worker = state.clone();
    tokio::spawn(async move {
        let event = |kind: &str, mut data: Value| -> Bytes {
            data["type"] = json!(kind);
            Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
        };
        let mut usage = Usage { prompt: prompt_len, completion: 0, cached: 0, details: worker.prompt_tokens_details };
        let message = json!({"id": id, "type": "message", "role": "assistant", "content": [],
            "model": request.model.as_str(), "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_len, "output_tokens": 0}});
        let opening = [
            event("message_start", json!({"message": message})),
            event("content_block_start", json!({"index": 0, "content_block": {"type": "text", "text": ""}})),
        ];
        for bytes in opening {
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
        while let Some(Produced { emitted: e, .. }) = tokens_rx.recv().await {
            usage.completion = e.index;
            usage.cached = e.cached_tokens;
            let delta = worker.tokenizer.decode(&[e.token]).unwrap_or_default();
            let data = json!({"index": 0, "delta": {"type": "text_delta", "text": delta}});
            if tx.send(event("content_block_delta", data)).await.is_err() {
                return;
            }
            if e.finished {
                break;
            }
        }
        let closing = [
            event("content_block_stop", json!({"index": 0})),
            event(
                "message_delta",
                json!({"delta": {"stop_reason": "max_tokens", "stop_sequence": null}, "usage": usage.anthropic_json()}),
            ),
            event("message_stop", json!({})),
        ];
        for bytes in closing {
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
    });
    sse(&state, rx)
}

/// A streamed completion or chat, chunk by chunk as vLLM's `completion_stream_generator` and
/// `chat_completion_stream_generator` write it: a chat opens every choice with its role when
/// the first output arrives; each token is a chunk of its choice's `index`; `usage` at the end
/// if asked for ([`Gathered::usage`]).
pub(super) fn stream(
    state: Arc<AppState>,
    endpoint: Endpoint,
    request: ParsedRequest,
    id: String,
    fanout: Fanout,
    submitted: Submitted,
    origin: Origin,
) -> Response {
    let Submitted { tokens: mut tokens_rx, ending } = submitted;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let worker = state.clone();
    tokio::spawn(async move {
        // When the client goes away, this task ends and drops `tokens_rx`: the engine aborts
        // the request's sequences and frees their blocks.
        let created = unix_now();
        let object = if endpoint == Endpoint::Completions { "text_completion" } else { "chat.completion.chunk" };
        let chunk = |choices: Value| -> Bytes {
            let body =
                json!({"id": id, "object": object, "created": created, "model": request.model, "choices": choices});
            Bytes::from(format!("data: {body}\n\n"))
        };
        let piece = |index: usize, delta: &str, finish: Value| match endpoint {
            Endpoint::Completions => {
                json!([{"index": index, "text": delta, "logprobs": null, "finish_reason": finish, "stop_reason": null}])
            }
            _ => json!([{"index": index, "delta": {"content": delta}, "logprobs": null, "finish_reason": finish}]),
        };
        let mut gathered = Gathered::new(fanout);
        while !gathered.done() {
            let Some(produced) = tokens_rx.recv().await else { break };
            if gathered.push(&produced) && endpoint == Endpoint::ChatCompletions {
                for index in 0..gathered.fanout().n() {
                    let role = json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                    if tx.send(chunk(role)).await.is_err() {
                        return;
                    }
                }
            }
            let e = produced.emitted;
            let text = worker.tokenizer.decode(&[e.token]).unwrap_or_default();
            let finish = if e.finished { json!("length") } else { Value::Null };
            if tx.send(chunk(piece(produced.seq, &text, finish))).await.is_err() {
                return;
            }
        }
        if let Ok(Ending::TransferFailed(reason)) = ending.await {
            // The status line is gone: the error goes in the stream, as vLLM and SGLang send it.
            let (_, error) = transfer_failure(&worker, &id, origin, &reason);
            if tx.send(Bytes::from(format!("data: {error}\n\n"))).await.is_ok() {
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            }
            return;
        }
        if request.include_usage {
            let mut body =
                json!({"id": id, "object": object, "created": created, "model": request.model, "choices": []});
            let mut usage = gathered.usage(true, worker.prompt_tokens_details);
            usage.cached = origin.reported_cached(usage.cached);
            body["usage"] = usage.json();
            if tx.send(Bytes::from(format!("data: {body}\n\n"))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    sse(&state, rx)
}

/// An event stream of what `rx` yields.
pub(super) fn sse(state: &AppState, rx: tokio::sync::mpsc::Receiver<Bytes>) -> Response {
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }));
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    tagged(state, response)
}
