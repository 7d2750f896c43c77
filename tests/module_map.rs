//! The crate's module map, read from `src/`: no import circle between
//! modules, the runtime (`actors`) reaches no HTTP code, prefill's actors
//! not decode's nor the other way round, the transport no request code
//! (docs/architecture.md's map; issue 49).
//!
//! A module's imports are the `crate::…` and `super::…` paths in its file
//! (comments and `#[cfg(test)]` modules left out), each resolved to the
//! longest module it names. A parent reaching its own children (`mod x;`,
//! `x::Y`) is containment, not an import, and is not counted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every module of `src/` and its file.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    fn walk(dir: &Path, prefix: &[String], out: &mut BTreeMap<Module, PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .expect("read src")
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        for p in entries {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                let mut next = prefix.to_vec();
                next.push(name);
                walk(&p, &next, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let mut m = prefix.to_vec();
                if stem != "mod" && stem != "lib" {
                    m.push(stem.to_string());
                }
                out.insert(m, p);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &[], &mut out);
    out
}

/// The file's text without comments and without its `#[cfg(test)]` part.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `crate::a::b` and `super::…::c` paths of `text`, as segments.
fn paths(text: &str) -> Vec<Vec<String>> {
    let bytes = text.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = [&b"crate::"[..], &b"super::"[..]]
            .iter()
            .any(|s| bytes[i..].starts_with(s))
            && (i == 0 || !ident(bytes[i - 1]));
        if !starts {
            i += 1;
            continue;
        }
        let mut segs = Vec::new();
        let mut j = i;
        loop {
            let s = j;
            while j < bytes.len() && ident(bytes[j]) {
                j += 1;
            }
            if s == j {
                break;
            }
            segs.push(text[s..j].to_string());
            if bytes[j..].starts_with(b"::") {
                j += 2;
            } else {
                break;
            }
        }
        i = j.max(i + 1);
        out.push(segs);
    }
    out
}

/// Each module's imports of other modules (see the module comment).
fn imports(mods: &BTreeMap<Module, PathBuf>) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut out = BTreeMap::new();
    for (m, file) in mods {
        let text = code(&std::fs::read_to_string(file).expect("read a module"));
        let mut to = BTreeSet::new();
        for segs in paths(&text) {
            let (mut base, rest): (Module, &[String]) = if segs[0] == "crate" {
                (Vec::new(), &segs[1..])
            } else {
                // `super` of a module is its parent, whether it is a file or a mod.rs
                let ups = segs.iter().take_while(|s| *s == "super").count();
                (m[..m.len().saturating_sub(ups)].to_vec(), &segs[ups..])
            };
            base.extend(rest.iter().cloned());
            // the longest prefix that is a module
            let target = (0..=base.len())
                .rev()
                .map(|n| base[..n].to_vec())
                .find(|p| mods.contains_key(p));
            if let Some(t) = target {
                let is_ancestor_or_self = m.len() >= t.len() && m[..t.len()] == t[..];
                let is_child = t.len() > m.len() && t[..m.len()] == m[..];
                if !is_ancestor_or_self && !is_child {
                    to.insert(t);
                }
            }
        }
        out.insert(m.clone(), to);
    }
    out
}

fn name(m: &Module) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

/// The strongly connected components of more than one module (Tarjan).
fn circles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a Module) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            let Some((w, _)) = t.g.get_key_value(w) else {
                continue;
            };
            if !t.index.contains_key(w) {
                visit(t, w);
                let l = t.low[v].min(t.low[w]);
                t.low.insert(v, l);
            } else if t.on.contains(w) {
                let l = t.low[v].min(t.index[w]);
                t.low.insert(v, l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(name(w));
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn graph() -> BTreeMap<Module, BTreeSet<Module>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    imports(&modules(&src))
}

fn m(path: &str) -> Module {
    path.split("::").map(str::to_string).collect()
}

#[test]
fn the_reader_sees_the_imports_it_must() {
    // Known imports, one of each form, so that a reader that found nothing
    // cannot pass the checks below.
    let g = graph();
    let has = |from: &str, to: &str| g.get(&m(from)).is_some_and(|s| s.contains(&m(to)));
    assert!(
        has("actors::prefill::producer", "actors::prefill::writer"),
        "crate:: path"
    );
    assert!(
        has("actors::decode::consumer", "actors::decode::router"),
        "super:: path"
    );
    assert!(has("transport::mooncake", "transport::ffi"), "within a folder");
    assert!(g.len() > 30, "{} modules read", g.len());
    // and it does find a circle where there is one
    let mut with_circle = g.clone();
    with_circle
        .entry(m("actors::prefill::writer"))
        .or_default()
        .insert(m("actors::prefill::producer"));
    assert_eq!(
        circles(&with_circle),
        vec![vec![
            "actors::prefill::producer".to_string(),
            "actors::prefill::writer".to_string()
        ]]
    );
}

#[test]
fn no_import_circle_in_src() {
    let found = circles(&graph());
    assert!(found.is_empty(), "modules that import each other: {found:?}");
}

#[test]
fn the_runtime_reaches_no_http_code_the_sides_not_each_other_and_the_transport_no_request_code() {
    let g = graph();
    let under = |m: &Module, top: &str| m.first().is_some_and(|f| f == top);
    for (from, to) in &g {
        for t in to {
            if under(from, "actors") {
                assert!(
                    !under(t, "side_channel") && !under(t, "side_channel_client"),
                    "{} imports {} (HTTP)",
                    name(from),
                    name(t)
                );
            }
            let side = |m: &Module, s: &str| m.len() > 1 && m[0] == "actors" && m[1] == s;
            for (a, b) in [("prefill", "decode"), ("decode", "prefill")] {
                assert!(
                    !(side(from, a) && side(t, b)),
                    "{} imports {}: the two sides share only what actors/ holds beside them",
                    name(from),
                    name(t)
                );
            }
            if under(from, "transport") {
                for request in [
                    "actors",
                    "fsm",
                    "side_channel",
                    "side_channel_client",
                    "wire",
                    "staging",
                ] {
                    assert!(
                        !under(t, request),
                        "{} imports {} (request code)",
                        name(from),
                        name(t)
                    );
                }
            }
        }
    }
}
