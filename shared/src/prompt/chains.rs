//! A chat template's emitted concatenation chains, emitted piece by piece.
//!
//! Templates build each message as one string and print it:
//! `{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}`. minijinja
//! makes a new string at each `+`, so a long document is copied once for every `+` after it,
//! then once more into the output. Printed piece by piece
//! (`{{- '<|im_start|>' }}{{ message.role }}{{ '\n' }}{{ content }}…`), it is copied once.
//!
//! The text is the same, and so is every failure: a chain that starts with a string literal
//! only renders if every piece is a string (minijinja, like Jinja2, adds a string only to a
//! string), and a string prints as itself; every piece but a literal goes through the
//! [`STRING_FILTER`], which fails where the `+` would have (Jinja2's `TypeError`: a template
//! that raises for vLLM must fail here too). Only such chains are split: a `{{ … }}` whose
//! expression is, at its top level, a string literal followed by `+` and operands that are
//! each a string literal or a name with attributes, subscripts, calls and filters (which bind
//! tighter than `+`). Anything else — another operator, a keyword (`if`, `not`, `in`…), a
//! brace, a lone `-` — leaves the tag as written. Whitespace control stays on the outer ends.

/// The filter each split piece goes through: the value if it is a string, else the error the
/// `+` would have raised. The environment that renders split templates must have it
/// ([`string_only`]).
pub const STRING_FILTER: &str = "kvgate_string_only";

/// [`STRING_FILTER`].
pub fn string_only(value: minijinja::Value) -> Result<minijinja::Value, minijinja::Error> {
    match value.kind() {
        minijinja::value::ValueKind::String => Ok(value),
        kind => Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("can only concatenate a string to a string, not {kind}"),
        )),
    }
}

/// `source` with every chain it can split split (see the module's docs). A template that
/// switches auto-escaping on (`{% autoescape %}`: JSON escaping quotes each piece) is left as
/// written.
pub fn split(source: &str) -> String {
    if source.contains("autoescape") {
        return source.to_owned();
    }
    let mut out = String::with_capacity(source.len() + source.len() / 8);
    let mut rest = source;
    while let Some(at) = rest.find('{') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let len = if rest.starts_with("{{") {
            let len = tag_len(rest, "}}");
            match split_tag(&rest[..len]) {
                Some(split) => out.push_str(&split),
                None => out.push_str(&rest[..len]),
            }
            len
        } else if rest.starts_with("{%") {
            let len = tag_len(rest, "%}");
            let len = if is_raw(&rest[..len]) { raw_len(rest, len) } else { len };
            out.push_str(&rest[..len]);
            len
        } else if rest.starts_with("{#") {
            // As minijinja reads it: the end is looked for past the opening and its mark.
            let skip = if matches!(rest.as_bytes().get(2), Some(b'-' | b'+')) { 3 } else { 2 };
            let len = rest[skip..].find("#}").map_or(rest.len(), |end| skip + end + 2);
            out.push_str(&rest[..len]);
            len
        } else {
            out.push('{');
            1
        };
        rest = &rest[len..];
    }
    out.push_str(rest);
    out
}

/// The length of the tag `rest` starts with, through its `end` outside string literals and
/// brackets, as minijinja's lexer finds it (or the whole of `rest` if it has none).
fn tag_len(rest: &str, end: &str) -> usize {
    let bytes = rest.as_bytes();
    let (mut i, mut depth) = (2, 0usize);
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => {
                i = string_end(bytes, i, quote);
                continue;
            }
            _ if depth == 0 && bytes[i..].starts_with(end.as_bytes()) => return i + end.len(),
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    rest.len()
}

/// Past the string literal opened by `quote` at `start` (backslash escapes skipped).
fn string_end(bytes: &[u8], start: usize, quote: u8) -> usize {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b if b == quote => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// Whether a `{% … %}` tag opens a raw block.
fn is_raw(tag: &str) -> bool {
    inner(tag, "{%", "%}").trim() == "raw"
}

/// The length through the `endraw` tag closing the raw block whose opening tag is `open` long.
fn raw_len(rest: &str, open: usize) -> usize {
    let mut at = open;
    while let Some(found) = rest[at..].find("{%") {
        let start = at + found;
        let len = tag_len(&rest[start..], "%}");
        if inner(&rest[start..start + len], "{%", "%}").trim() == "endraw" {
            return start + len;
        }
        at = start + 2;
    }
    rest.len()
}

/// A tag's text inside its delimiters and whitespace-control marks.
fn inner<'a>(tag: &'a str, open: &str, close: &str) -> &'a str {
    let body = tag.strip_prefix(open).unwrap_or(tag);
    let body = body.strip_suffix(close).unwrap_or(body);
    let body = body.strip_prefix(['-', '+']).unwrap_or(body);
    body.strip_suffix(['-', '+']).unwrap_or(body)
}

/// A `{{ … }}` tag split into one tag per piece, if its expression is a chain to split.
fn split_tag(tag: &str) -> Option<String> {
    let body = tag.strip_prefix("{{")?.strip_suffix("}}")?;
    let (left, body) = match body.strip_prefix('-') {
        Some(b) => ("-", b),
        None => ("", body),
    };
    let (body, right) = match body.strip_suffix('-') {
        Some(b) => (b, "-"),
        None => (body, ""),
    };
    let pieces = top_level_pieces(body)?;
    let first = pieces.first()?.trim_ascii();
    if pieces.len() < 2 || !is_string_literal(first) || !pieces.iter().all(|p| is_operand(p.trim_ascii())) {
        return None;
    }
    let mut out = String::with_capacity(tag.len() + 6 * pieces.len());
    for (i, piece) in pieces.iter().enumerate() {
        let open = if i == 0 { left } else { "" };
        let close = if i == pieces.len() - 1 { right } else { "" };
        let piece = piece.trim_ascii();
        match is_string_literal(piece) {
            true => out.push_str(&format!("{{{{{open} {piece} {close}}}}}")),
            false => out.push_str(&format!("{{{{{open} {piece} | {STRING_FILTER} {close}}}}}")),
        }
    }
    Some(out)
}

/// The expression cut at its top-level `+`s; `None` if it has a brace outside strings (a dict
/// literal, or a tag end this scan may have misread).
fn top_level_pieces(expr: &str) -> Option<Vec<&str>> {
    let bytes = expr.as_bytes();
    let (mut pieces, mut start, mut depth, mut i) = (Vec::new(), 0, 0usize, 0);
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => {
                i = string_end(bytes, i, quote);
                continue;
            }
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth = depth.checked_sub(1)?,
            b'{' | b'}' => return None,
            b'+' if depth == 0 => {
                pieces.push(&expr[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    (depth == 0).then(|| {
        pieces.push(&expr[start..]);
        pieces
    })
}

fn is_string_literal(s: &str) -> bool {
    let bytes = s.as_bytes();
    matches!(bytes.first(), Some(&q @ (b'\'' | b'"')) if string_end(bytes, 0, q) == bytes.len() && bytes.len() >= 2)
}

/// A string literal, or a name followed by `.attr`, `[…]`, `(…)` and `| filter`s only.
fn is_operand(s: &str) -> bool {
    if is_string_literal(s) {
        return true;
    }
    let bytes = s.as_bytes();
    let mut i = ident_end(bytes, 0);
    if i == 0 || is_keyword(&s[..i]) {
        return false;
    }
    while i < bytes.len() {
        match bytes[i] {
            b'.' => {
                let end = ident_end(bytes, i + 1);
                if end == i + 1 {
                    return false;
                }
                i = end;
            }
            open @ (b'[' | b'(') => match group_end(bytes, i, open) {
                Some(end) => i = end,
                None => return false,
            },
            b'|' => {
                let start = skip_spaces(bytes, i + 1);
                let end = ident_end(bytes, start);
                if end == start || is_keyword(&s[start..end]) {
                    return false;
                }
                i = end;
            }
            b' ' | b'\t' | b'\n' | b'\r' if bytes.get(skip_spaces(bytes, i)) == Some(&b'|') => {
                i = skip_spaces(bytes, i);
            }
            _ => return false,
        }
    }
    true
}

fn ident_end(bytes: &[u8], start: usize) -> usize {
    let mut i = start;
    while i < bytes.len() && (bytes[i] == b'_' || bytes[i].is_ascii_alphanumeric()) {
        if i == start && bytes[i].is_ascii_digit() {
            return start;
        }
        i += 1;
    }
    i
}

fn skip_spaces(bytes: &[u8], start: usize) -> usize {
    let mut i = start;
    while i < bytes.len() && bytes[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// Past the bracketed group opened at `start` (strings inside skipped).
fn group_end(bytes: &[u8], start: usize, open: u8) -> Option<usize> {
    let close = if open == b'[' { b']' } else { b')' };
    let mut depth = 0usize;
    let mut i = start;
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => {
                i = string_end(bytes, i, quote);
                continue;
            }
            b'{' | b'}' => return None,
            b if b == open => depth += 1,
            b if b == close => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn is_keyword(word: &str) -> bool {
    matches!(
        word,
        "if" | "else" | "and" | "or" | "not" | "in" | "is" | "true" | "false" | "none" | "True" | "False" | "None"
    )
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn a_chain_that_starts_with_a_string_is_printed_piece_by_piece() {
        assert_eq!(
            split("{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"),
            "{{- '<|im_start|>' }}{{ message.role | kvgate_string_only }}{{ '\\n' }}{{ content | kvgate_string_only }}\
             {{ '<|im_end|>' }}{{ '\\n' }}"
        );
        assert_eq!(
            split("a{{ \"x\" + messages[0]['content'] | trim + m.c.strip('\\n') -}}b"),
            "a{{ \"x\" }}{{ messages[0]['content'] | trim | kvgate_string_only }}\
             {{ m.c.strip('\\n') | kvgate_string_only -}}b"
        );
    }

    #[test]
    fn anything_else_is_left_as_written() {
        for tag in [
            "{{ a + b }}",
            "{{ 'a' }}",
            "{{ 'a' + b if c else d }}",
            "{{ 'a' + b - c }}",
            "{{ 'a' + not b }}",
            "{{ 'a' + (b + c) * 2 }}",
            "{{ 'a' + {'k': 1}['k'] }}",
            "{{ 'a' + b is defined }}",
            "{{ 'a' + 1 }}",
            "{% set x = 'a' + b %}{{ x }}",
            "{# {{ 'a' + b }} #}",
            "{% raw %}{{ 'a' + b }}{% endraw %}",
            "{{ '}}' + b ~ c }}",
            "{{ 'a' + b.0 }}",
            "{{ 'a' +\x0Bb }}",
            "{{ {'k': {'j': 'x'}}['k']['j'] ~ '{{ \"a\" + b }}' }}",
            "{#} {{ ' #}{{ 'x }} {{ \"a\" + b }}' }}",
            "{% raw %}{% if x ≥ 1 %}{{ 'a' + b }}{% endraw %}",
            "{% autoescape 'json' %}{{ 'a' + b }}{% endautoescape %}",
        ] {
            assert_eq!(split(tag), tag, "{tag}");
        }
    }

    #[test]
    fn a_split_template_renders_the_same_text() {
        let source = "{% for m in messages %}{{- '<' + m.role + '>' + m.content | trim + '\\n' }}{% endfor %}";
        let render = |source: &str, content: minijinja::Value| {
            let mut env = minijinja::Environment::new();
            env.add_filter(super::STRING_FILTER, super::string_only);
            env.add_template("t", source).unwrap();
            let ctx = minijinja::context! { messages => vec![
                minijinja::context! { role => "user", content => " hi " },
                minijinja::context! { role => "assistant", content => content },
            ]};
            env.get_template("t").unwrap().render(ctx).map_err(|e| e.kind())
        };
        assert_ne!(split(source), source);
        let text = minijinja::Value::from("a }} b + c");
        assert_eq!(render(&split(source), text.clone()), render(source, text));
        // Where the `+` fails, so does the split template (`trim` makes a string of anything).
        let source = source.replace(" | trim", "");
        for not_a_string in [minijinja::Value::from(1), minijinja::Value::from(())] {
            let (split, whole) = (render(&split(&source), not_a_string.clone()), render(&source, not_a_string));
            assert!(split.is_err() && whole.is_err(), "{split:?} {whole:?}");
        }
    }
}
