//! The import drawing of every crate's modules (proto, k3-store, k3-worker, k3-ctl, tests), and
//! the rules it must keep (ARCHITECTURE.md, "Rooms and arrows"): no import circle between the
//! modules (files) of any crate; in k3-store nothing in the weights runtime (`src/runtime/`)
//! imports from outside it (the daemon, a worker's attach side, the command line, the
//! process-level modules), and the daemon and the attach side meet only there; in k3-worker the
//! layers point down — front ends over the engine over the model over the kernels.
//!
//! The graph is read from the sources: every `crate::…` path (use trees expanded), `super::…`,
//! a parent's `child::…` and a binary's `<lib>::…`, outside comments, string literals and
//! `#[cfg(test)]` items (tests may reach anywhere). An edge goes from the module a file defines
//! to the deepest module the path names. Run with `-- --nocapture` to print the drawings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module name (`runtime::ring`, `daemon`, `crate` for lib.rs — or main.rs in a crate without
/// a library —, `main` for a binary beside a library) → source.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let has_lib = src.join("lib.rs").exists();
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    (files.into_iter())
        .map(|p| {
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let mut segs: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into()).collect();
            if segs.last().is_some_and(|s| s == "mod") {
                segs.pop();
            }
            let name = match segs.join("::").as_str() {
                "lib" => "crate".to_string(),
                "main" if !has_lib => "crate".to_string(),
                n => n.to_string(),
            };
            (name, p)
        })
        .collect()
}

/// The text with comments, string and char literals blanked out (newlines kept).
fn strip(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_char(prev(&b, i)) {
            // A raw string: r"…" or r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == '\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                } else if b[i] == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (b.get(i + 2) == Some(&'\'') || next == Some('\\')) {
            // A char literal ('x', '\n', '\u{..}'); a lifetime has no closing quote.
            i += 1;
            while i < b.len() && b[i] != '\'' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn prev(b: &[char], i: usize) -> char {
    if i == 0 {
        ' '
    } else {
        b[i - 1]
    }
}

fn ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The text without the items marked `#[cfg(test)]` (the attribute's item up to its `;` or its
/// matching `}`).
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let semi = item.find(';');
        let open = item.find('{');
        let end = match (semi, open) {
            (Some(s), Some(o)) if s < o => s + 1,
            (Some(s), None) => s + 1,
            (_, Some(o)) => {
                let mut depth = 0;
                let mut end = item.len();
                for (k, ch) in item[o..].char_indices() {
                    match ch {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = o + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (None, None) => item.len(),
        };
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// Every path that starts with `root::` in `text`, use trees expanded (`a::{b, c::d}` gives
/// `a::b` and `a::c::d`), as segment lists after the root.
fn paths_after(text: &str, root: &str) -> Vec<Vec<String>> {
    let b: Vec<char> = text.chars().collect();
    let pat: Vec<char> = format!("{root}::").chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + pat.len() <= b.len() {
        if b[i..i + pat.len()] == pat[..] && !ident_char(prev(&b, i)) && prev(&b, i) != ':' {
            let mut j = i + pat.len();
            tree(&b, &mut j, &mut Vec::new(), &mut out);
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// Parse a use tree at `b[*j..]` below `prefix`, pushing every leaf path.
fn tree(b: &[char], j: &mut usize, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let skip_ws = |j: &mut usize| {
        while *j < b.len() && b[*j].is_whitespace() {
            *j += 1;
        }
    };
    skip_ws(j);
    if b.get(*j) == Some(&'{') {
        *j += 1;
        loop {
            skip_ws(j);
            match b.get(*j) {
                Some('}') => {
                    *j += 1;
                    return;
                }
                Some(',') => *j += 1,
                None => return,
                _ => {
                    let depth = prefix.len();
                    tree(b, j, prefix, out);
                    prefix.truncate(depth);
                }
            }
        }
    }
    let start = *j;
    while *j < b.len() && (ident_char(b[*j]) || b[*j] == '*') {
        *j += 1;
    }
    let seg: String = b[start..*j].iter().collect();
    if seg.is_empty() {
        out.push(prefix.clone());
        return;
    }
    prefix.push(seg);
    skip_ws(j);
    if b.get(*j) == Some(&':') && b.get(*j + 1) == Some(&':') {
        *j += 2;
        tree(b, j, prefix, out);
    } else {
        out.push(prefix.clone());
        // `x as y`: the alias is not a path.
    }
}

/// The deepest known module a path (absolute segments) names.
fn resolve(known: &BTreeSet<String>, segs: &[String]) -> Option<String> {
    (1..=segs.len())
        .rev()
        .map(|k| segs[..k].join("::"))
        .find(|m| known.contains(m))
}

/// The modules declared `#[cfg(test)] mod name;` (a test-only file) in module `parent`'s text.
fn test_children(parent: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        rest = &rest[at + "#[cfg(test)]".len()..];
        let item = rest.trim_start();
        let item = item.strip_prefix("pub(crate) ").unwrap_or(item);
        if let Some(decl) = item.strip_prefix("mod ") {
            let name: String = decl.chars().take_while(|&c| ident_char(c)).collect();
            if decl[name.len()..].trim_start().starts_with(';') {
                out.push(match parent {
                    "crate" => name,
                    p => format!("{p}::{name}"),
                });
            }
        }
    }
    out
}

/// The import graph of the crate whose sources are in `src` (its library's name `lib`, the root
/// a binary beside it names it by): module → modules it imports.
fn graph(src: &Path, lib: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut mods = modules(src);
    // Test-only files (and what they contain) are not part of the drawing.
    let tests: Vec<String> = (mods.iter())
        .flat_map(|(m, p)| test_children(m, &strip(&std::fs::read_to_string(p).unwrap())))
        .collect();
    mods.retain(|m, _| {
        !tests
            .iter()
            .any(|t| m == t || m.starts_with(&format!("{t}::")))
    });
    let known: BTreeSet<String> = mods.keys().cloned().collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, path) in &mods {
        let text = without_tests(&strip(&std::fs::read_to_string(path).unwrap()));
        let segs: Vec<String> = match name.as_str() {
            "crate" | "main" => vec![],
            n => n.split("::").map(String::from).collect(),
        };
        let is_mod_rs = name == "crate"
            || path
                .file_name()
                .is_some_and(|f| f == "mod.rs" || f == "lib.rs");
        // The module `super` names (the parent, for a `mod.rs` as for a plain file).
        let parent: Vec<String> = segs[..segs.len().saturating_sub(1)].to_vec();
        let mut targets: Vec<Vec<String>> = Vec::new();
        let root = if name == "main" { lib } else { "crate" };
        targets.extend(paths_after(&text, root));
        for p in paths_after(&text, "super") {
            targets.push(parent.iter().cloned().chain(p).collect());
        }
        // A module's children named relatively (`sessions::Sessions` in daemon/mod.rs).
        if is_mod_rs && name != "main" {
            for child in known.iter().filter_map(|k| {
                let rest = if segs.is_empty() {
                    Some(k.as_str())
                } else {
                    k.strip_prefix(&format!("{}::", segs.join("::")))
                };
                rest.filter(|r| !r.contains("::") && *r != "crate" && *r != "main")
            }) {
                for p in paths_after(&text, child) {
                    targets.push(
                        segs.iter()
                            .cloned()
                            .chain(std::iter::once(child.to_string()))
                            .chain(p)
                            .collect(),
                    );
                }
            }
        }
        let e = g.entry(name.clone()).or_default();
        for t in targets {
            if let Some(m) = resolve(&known, &t) {
                if &m != name && m != "crate" {
                    e.insert(m);
                }
            }
        }
    }
    g
}

/// Strongly connected components of more than one module (Tarjan).
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on.insert(v);
            let g = self.g;
            for w in g.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    scc.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

/// The top-level folder (or file) of a module.
fn folder(m: &str) -> &str {
    m.split("::").next().unwrap_or(m)
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every crate of the workspace: its sources and its library's name.
fn crates() -> Vec<(&'static str, PathBuf, &'static str)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    [
        ("proto", "k3_proto"),
        ("k3-store", "k3_store"),
        ("k3-worker", "k3_worker"),
        ("k3-ctl", "k3_ctl"),
        ("tests", "k3_tests"),
    ]
    .into_iter()
    .map(|(dir, lib)| (dir, root.join(dir).join("src"), lib))
    .collect()
}

fn print(g: &BTreeMap<String, BTreeSet<String>>) {
    for (m, to) in g {
        let to: Vec<&str> = to.iter().map(String::as_str).collect();
        println!("  {m} -> {}", to.join(", "));
    }
}

/// The edges between modules of different top-level folders.
fn across(g: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<(String, String)> {
    (g.iter())
        .flat_map(|(m, to)| to.iter().map(move |t| (m, t)))
        .filter(|(m, t)| folder(m) != folder(t))
        .map(|(m, t)| (folder(m).to_string(), folder(t).to_string()))
        .collect()
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut wrong = Vec::new();
    for (dir, src, lib) in crates() {
        let g = graph(&src, lib);
        assert!(
            !g.is_empty(),
            "{dir}: read no modules from {}",
            src.display()
        );
        println!("{dir} module imports (non-test code):");
        print(&g);
        let c = circles(&g);
        println!("{dir} circles: {c:?}");
        if !c.is_empty() {
            wrong.push(format!("{dir}: {c:?}"));
        }
    }
    assert!(wrong.is_empty(), "import circles: {wrong:?}");
}

/// k3-worker's layers point down: the front ends over the engine (over the constraints) over the
/// model over the kernels (the text formats and the tokenizer beside them, the scoring of a text
/// beside the engine); nothing below names what is above.
#[test]
fn the_worker_s_layers_point_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../k3-worker/src");
    let g = graph(&src, "k3_worker");
    let rank = |f: &str| match f {
        "main" => 6,
        "front" => 5,
        // The engine, and the scoring of a text (`--perplexity`) beside it over the model.
        "engine" | "eval" => 4,
        // Grammar-constrained decoding: over the text formats, under the engine that applies it.
        "constrain" => 3,
        "text" => 2,
        "model" | "tokenizer" => 1,
        "kernels" => 0,
        _ => 7,
    };
    let up: Vec<(String, String)> = across(&g)
        .into_iter()
        .filter(|(m, t)| m != "crate" && rank(t) >= rank(m))
        .collect();
    println!("k3-worker arrows between folders: {:?}", across(&g));
    assert!(up.is_empty(), "k3-worker imports up or sideways: {up:?}");
}

#[test]
fn the_import_drawing_has_no_circle_and_the_runtime_imports_nothing_above_it() {
    let g = graph(&src(), "k3_store");
    println!("k3-store module imports (non-test code):");
    for (m, to) in &g {
        let to: Vec<&str> = to.iter().map(String::as_str).collect();
        println!("  {m} -> {}", to.join(", "));
    }
    let mut folders: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (m, to) in &g {
        for t in to {
            if folder(m) != folder(t) {
                folders.entry(folder(m)).or_default().insert(folder(t));
            }
        }
    }
    println!("by folder:");
    for (f, to) in &folders {
        let to: Vec<&str> = to.iter().copied().collect();
        println!("  {f} -> {}", to.join(", "));
    }
    let c = circles(&g);
    println!("circles: {c:?}");
    assert!(c.is_empty(), "import circles: {c:?}");
    let up: Vec<(&String, &String)> = (g.iter())
        .filter(|(m, _)| folder(m) == "runtime")
        .flat_map(|(m, to)| to.iter().map(move |t| (m, t)))
        .filter(|(_, t)| folder(t) != "runtime")
        .collect();
    assert!(up.is_empty(), "the runtime imports from outside it: {up:?}");
    // The daemon and a worker's attach side meet only in the runtime and the wire protocol.
    let across: Vec<(&String, &String)> = (g.iter())
        .flat_map(|(m, to)| to.iter().map(move |t| (m, t)))
        .filter(|(m, t)| {
            matches!(
                (folder(m), folder(t)),
                ("daemon", "attach") | ("attach", "daemon")
            )
        })
        .collect();
    assert!(across.is_empty(), "daemon <-> attach imports: {across:?}");
}

/// The reader of the drawing finds what a plausible mistake would add (so the test above can
/// fail): a use tree, a `super` path, a relative child path, code in comments, strings and test
/// items ignored.
#[test]
fn the_drawing_reads_use_trees_super_and_children_but_not_comments_or_tests() {
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path();
    let w = |p: &str, t: &str| {
        let f = s.join(p);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, t).unwrap();
    };
    w("lib.rs", "pub mod a; pub mod b;");
    w(
        "a/mod.rs",
        "pub mod x; pub mod y;\n#[cfg(test)]\nmod t;\nuse crate::{b::{self, Z}, a::x::Q};\nfn f() { y::g(); }\n",
    );
    w("a/t.rs", "use crate::b::B;\nuse super::Q;\n");
    w("a/x.rs", "use super::y::T; // crate::b::Nope\n");
    w(
        "a/y.rs",
        "const S: &str = \"crate::b::No\";\n#[cfg(test)]\nmod tests { use crate::a::x; }\n",
    );
    w("b.rs", "fn g() -> crate::a::y::T { todo!() }\n");
    let g = graph(s, "lib");
    let set = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(g["a"], set(&["b", "a::x", "a::y"]));
    assert_eq!(g["a::x"], set(&["a::y"]));
    assert!(g["a::y"].is_empty(), "{g:?}");
    assert_eq!(g["b"], set(&["a::y"]));
    assert!(!g.contains_key("a::t"), "a test-only file: {g:?}");
    assert!(circles(&g).is_empty());
    w("a/y.rs", "use crate::b;\n");
    let c = circles(&graph(s, "lib"));
    assert_eq!(c, vec![vec!["a::y".to_string(), "b".to_string()]]);
}
