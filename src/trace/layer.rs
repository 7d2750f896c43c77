//! The `tracing_subscriber` layer that turns spans and events into Chrome
//! trace events.

use super::sink::*;
use super::*;

// ---------------------------------------------------------------- fields

pub(super) struct JsonFields<'a>(&'a mut Map<String, Value>);

impl Visit for JsonFields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0
            .insert(field.name().into(), Value::String(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), Value::String(value.into()));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), json!(value));
    }
}

/// Children of a request span carry its `request` and `side`.
pub(super) fn inherit(lane: &Lane, args: &mut Map<String, Value>) {
    for (k, v) in [("request", &lane.request), ("side", &lane.side)] {
        if let Some(v) = v {
            args.entry(k).or_insert_with(|| v.clone());
        }
    }
}

/// `msg` spans are shown under their message kind.
pub(super) fn display_name(span: &str, args: &Map<String, Value>) -> String {
    match (span, args.get("kind")) {
        (names::MSG, Some(Value::String(k))) => k.clone(),
        _ => span.to_string(),
    }
}

// ---------------------------------------------------------------- layer

/// A span's record while it is open (kept in the registry's extensions).
pub(super) struct SpanRec {
    pub(super) ts_ns: u64,
    pub(super) name: String,
    pub(super) cat: &'static str,
    pub(super) lane: Arc<Lane>,
    pub(super) args: Map<String, Value>,
    pub(super) entered: bool,
    pub(super) root: bool,
}

/// The `tracing_subscriber` layer that records the Chrome trace. Build it
/// with [`ChromeTrace::layer`] or [`ChromeTrace::builder`].
#[derive(Clone)]
pub struct ChromeTraceLayer {
    pub(super) sink: Arc<Sink>,
}

impl std::fmt::Debug for ChromeTraceLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChromeTraceLayer")
            .field("path", &self.sink.path)
            .finish()
    }
}

impl<S> Layer<S> for ChromeTraceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let ts_ns = self.sink.now_ns();
        let meta = attrs.metadata();
        let mut args = Map::new();
        attrs.record(&mut JsonFields(&mut args));
        let root = meta.name() == names::REQUEST && args.contains_key("side") && args.contains_key("request");
        let lane = if root {
            self.sink.request_lane(&args)
        } else {
            let parent = span
                .parent()
                .and_then(|p| p.extensions().get::<SpanRec>().map(|r| r.lane.clone()));
            parent.unwrap_or_else(|| self.sink.thread_lane())
        };
        inherit(&lane, &mut args);
        if root {
            self.sink.inner.lock().open_roots.insert(
                lane.tid,
                OpenRoot {
                    ts_ns,
                    lane: lane.clone(),
                    args: args.clone(),
                },
            );
        }
        span.extensions_mut().insert(SpanRec {
            ts_ns,
            name: display_name(meta.name(), &args),
            cat: meta.name(),
            lane,
            args,
            entered: false,
            root,
        });
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        if let Some(rec) = ext.get_mut::<SpanRec>() {
            values.record(&mut JsonFields(&mut rec.args));
            rec.name = display_name(rec.cat, &rec.args);
        }
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(rec) = span.extensions_mut().get_mut::<SpanRec>() {
                rec.entered = true;
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let ts_ns = self.sink.now_ns();
        let meta = event.metadata();
        let mut args = Map::new();
        event.record(&mut JsonFields(&mut args));
        let name = match args.remove("message") {
            Some(Value::String(s)) => s,
            Some(v) => v.to_string(),
            None => meta.name().to_string(),
        };
        args.insert("level".into(), json!(meta.level().as_str()));
        args.insert("target".into(), json!(meta.target()));
        let lane = ctx
            .event_span(event)
            .and_then(|s| s.extensions().get::<SpanRec>().map(|r| r.lane.clone()))
            .unwrap_or_else(|| self.sink.thread_lane());
        inherit(&lane, &mut args);
        self.sink.push(Rec {
            phase: Phase::Instant,
            ts_ns,
            name,
            cat: "event",
            lane,
            args,
        });
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let ts = self.sink.now_ns();
        let Some(span) = ctx.span(&id) else { return };
        let Some(rec) = span.extensions_mut().remove::<SpanRec>() else {
            return;
        };
        let dur_ns = ts.saturating_sub(rec.ts_ns);
        if rec.root {
            self.sink.inner.lock().open_roots.remove(&rec.lane.tid);
        }
        let phase = if rec.root || rec.entered {
            Phase::Complete { dur_ns }
        } else {
            Phase::Async {
                dur_ns,
                id: self.sink.next_async.fetch_add(1, Ordering::Relaxed),
            }
        };
        self.sink.push(Rec {
            phase,
            ts_ns: rec.ts_ns,
            name: rec.name,
            cat: rec.cat,
            lane: rec.lane,
            args: rec.args,
        });
    }
}
