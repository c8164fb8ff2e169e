//! Which shape of message `content` a chat template expects, detected the way vLLM does.
//!
//! vLLM (`_detect_content_format` in `renderers/hf.py`) parses the template and looks for a
//! `for` loop over a message's `content`. If it finds one the template iterates content parts,
//! so every message's content is handed over as a list of `{"type": "text", "text": …}` parts
//! ([`ContentFormat::Openai`]); otherwise text parts are joined with `"\n"` into one string
//! ([`ContentFormat::String`]). The two give different prompts for the same request, so the
//! router must decide exactly as the engine does.
//!
//! The detection follows variables the way vLLM's does, without scoping:
//! - `messages`, and any variable set from it (`{% set ms = messages[1:] %}`, transitively);
//! - loop variables over those (`{% for m in ms %}`), and again anything set from them;
//! - a loop over `m.content` / `m['content']` (through filters, tests and slices), over a
//!   variable set from it, over a macro argument that received it, or over a variable
//!   named `content`.
//!
//! ```
//! use kvgate_shared::prompt::content_format::{detect, ContentFormat};
//!
//! let string = "{% for m in messages %}{{ m.content }}{% endfor %}";
//! let parts = "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}";
//! assert_eq!(detect(string), ContentFormat::String);
//! assert_eq!(detect(parts), ContentFormat::Openai);
//! ```

use std::collections::{HashMap, HashSet};

use minijinja::machinery::ast::{CallArg, Expr, Stmt};
use serde::{Deserialize, Serialize};

/// How message content reaches the chat template (vLLM's `--chat-template-content-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentFormat {
    /// Detect from the template (vLLM's default).
    #[default]
    Auto,
    /// Content is one string; text parts are joined with `"\n"`.
    String,
    /// Content is a list of `{"type": "text", "text": …}` parts.
    Openai,
}

impl ContentFormat {
    /// This setting for `template`: itself, or the detected format when [`ContentFormat::Auto`].
    pub fn resolve(self, template: &str) -> ContentFormat {
        match self {
            ContentFormat::Auto => detect(template),
            fixed => fixed,
        }
    }
}

/// Detects the content format of a chat template. A template that does not parse is
/// [`ContentFormat::String`] (vLLM falls back to its default, `string`, too); compiling it
/// reports the error.
pub fn detect(template: &str) -> ContentFormat {
    let Ok(ast) = minijinja::machinery::parse(template, "chat", Default::default()) else {
        return ContentFormat::String;
    };
    let mut facts = Facts::default();
    facts.stmt(&ast);
    if facts.loops_over_content() {
        ContentFormat::Openai
    } else {
        ContentFormat::String
    }
}

/// What the detection needs from the template, collected in one walk.
#[derive(Default)]
struct Facts<'t, 'a> {
    /// `for target in iter` loops whose target is a plain variable.
    loops: Vec<(&'a str, &'t Expr<'a>)>,
    /// `set name = expr` and `with name = expr` assignments.
    assigns: Vec<(&'a str, &'t Expr<'a>)>,
    /// Macro name → its argument names.
    macros: HashMap<&'a str, Vec<&'a str>>,
    /// `name(args…)` calls: the callee and its positional arguments.
    calls: Vec<(&'a str, Vec<&'t Expr<'a>>)>,
}

impl<'t, 'a> Facts<'t, 'a> {
    fn stmts(&mut self, stmts: &'t [Stmt<'a>]) {
        stmts.iter().for_each(|s| self.stmt(s));
    }

    fn stmt(&mut self, stmt: &'t Stmt<'a>) {
        match stmt {
            Stmt::Template(t) => self.stmts(&t.children),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::ForLoop(f) => {
                if let Expr::Var(target) = &f.target {
                    self.loops.push((target.id, &f.iter));
                }
                self.expr(&f.iter);
                if let Some(filter) = &f.filter_expr {
                    self.expr(filter);
                }
                self.stmts(&f.body);
                self.stmts(&f.else_body);
            }
            Stmt::IfCond(i) => {
                self.expr(&i.expr);
                self.stmts(&i.true_body);
                self.stmts(&i.false_body);
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    if let Expr::Var(v) = target {
                        self.assigns.push((v.id, value));
                    }
                    self.expr(value);
                }
                self.stmts(&w.body);
            }
            Stmt::Set(s) => {
                if let Expr::Var(v) = &s.target {
                    self.assigns.push((v.id, &s.expr));
                }
                self.expr(&s.expr);
            }
            Stmt::SetBlock(s) => self.stmts(&s.body),
            Stmt::AutoEscape(a) => self.stmts(&a.body),
            Stmt::FilterBlock(f) => {
                self.expr(&f.filter);
                self.stmts(&f.body);
            }
            Stmt::Macro(m) => {
                let args = m.args.iter().filter_map(|a| if let Expr::Var(v) = a { Some(v.id) } else { None });
                self.macros.insert(m.name, args.collect());
                self.stmts(&m.body);
            }
            Stmt::CallBlock(c) => {
                self.call(&c.call.expr, &c.call.args);
                self.stmts(&c.macro_decl.body);
            }
            Stmt::Do(d) => self.call(&d.call.expr, &d.call.args),
            _ => {}
        }
    }

    fn call(&mut self, callee: &'t Expr<'a>, args: &'t [CallArg<'a>]) {
        if let Expr::Var(name) = callee {
            let positional = args.iter().filter_map(|a| if let CallArg::Pos(e) = a { Some(e) } else { None });
            self.calls.push((name.id, positional.collect()));
        }
        self.expr(callee);
        self.args(args);
    }

    fn args(&mut self, args: &'t [CallArg<'a>]) {
        for arg in args {
            match arg {
                CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) | CallArg::KwargSplat(e) => self.expr(e),
            }
        }
    }

    fn expr(&mut self, expr: &'t Expr<'a>) {
        match expr {
            Expr::Var(_) | Expr::Const(_) => {}
            Expr::Slice(s) => {
                self.expr(&s.expr);
                for part in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    self.expr(part);
                }
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => {
                self.expr(&b.left);
                self.expr(&b.right);
            }
            Expr::Compare(c) => {
                self.expr(&c.expr);
                c.ops.iter().for_each(|op| self.expr(&op.expr));
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.expr(&i.true_expr);
                if let Some(f) = &i.false_expr {
                    self.expr(f);
                }
            }
            Expr::Filter(f) => {
                if let Some(e) = &f.expr {
                    self.expr(e);
                }
                self.args(&f.args);
            }
            Expr::Test(t) => {
                self.expr(&t.expr);
                self.args(&t.args);
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            Expr::Call(c) => self.call(&c.expr, &c.args),
            Expr::List(l) => l.items.iter().for_each(|e| self.expr(e)),
            Expr::Tuple(t) => t.items.iter().for_each(|e| self.expr(e)),
            Expr::Map(m) => m.keys.iter().chain(&m.values).for_each(|e| self.expr(e)),
        }
    }

    /// `vars` plus every variable that receives one of them: assigned from it, or bound to a
    /// macro argument it is passed as. Transitive.
    fn aliases(&self, mut vars: HashSet<&'a str>) -> HashSet<&'a str> {
        loop {
            let before = vars.len();
            for (lhs, rhs) in &self.assigns {
                if vars.iter().any(|v| is_var_or_elems(rhs, v, None)) {
                    vars.insert(lhs);
                }
            }
            let passed = self.received(|e| vars.iter().any(|v| is_var_or_elems(e, v, None)));
            vars.extend(passed);
            if vars.len() == before {
                return vars;
            }
        }
    }

    /// Macro argument names that receive an expression matching `pred` in some call.
    fn received(&self, pred: impl Fn(&Expr<'a>) -> bool) -> Vec<&'a str> {
        let mut out = Vec::new();
        for (callee, args) in &self.calls {
            let Some(params) = self.macros.get(callee) else { continue };
            out.extend(params.iter().zip(args).filter(|(_, arg)| pred(arg)).map(|(param, _)| *param));
        }
        out
    }

    fn loops_over_content(&self) -> bool {
        let messages = self.aliases(HashSet::from(["messages"]));
        let message: HashSet<&str> = self
            .loops
            .iter()
            .filter(|(_, iter)| messages.iter().any(|v| is_var_or_elems(iter, v, None)))
            .map(|(target, _)| *target)
            .collect();
        let message = self.aliases(message);
        let is_content = |e: &Expr<'a>| message.iter().any(|m| is_var_or_elems(e, m, Some("content")));
        let mut content: HashSet<&str> = HashSet::from(["content"]);
        content.extend(self.assigns.iter().filter(|(_, rhs)| is_content(rhs)).map(|(lhs, _)| *lhs));
        content.extend(self.received(is_content));
        let content = self.aliases(content);
        self.loops.iter().any(|(_, iter)| is_content(iter) || content.iter().any(|c| is_var_or_elems(iter, c, None)))
    }
}

/// vLLM's `_is_var_or_elems_access`: `expr` is `var` (or `var.key` / `var['key']` when `key`
/// is given), possibly under filters, tests and slices.
fn is_var_or_elems(expr: &Expr<'_>, var: &str, key: Option<&str>) -> bool {
    match expr {
        Expr::Filter(f) => f.expr.as_ref().is_some_and(|e| is_var_or_elems(e, var, key)),
        Expr::Test(t) => is_var_or_elems(&t.expr, var, key),
        Expr::Slice(s) => is_var_or_elems(&s.expr, var, key),
        _ => match key {
            None => matches!(expr, Expr::Var(v) if v.id == var),
            Some(key) => match expr {
                Expr::GetAttr(g) => g.name == key && matches!(&g.expr, Expr::Var(v) if v.id == var),
                Expr::GetItem(g) => {
                    matches!(&g.subscript_expr, Expr::Const(c) if c.value.as_str() == Some(key))
                        && matches!(&g.expr, Expr::Var(v) if v.id == var)
                }
                _ => false,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_templates() {
        for t in [
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            "{% for m in messages %}{% for t in m.tool_calls %}{{ t }}{% endfor %}{% endfor %}",
            // A loop over some other `content` attribute is not a message's content.
            "{% for d in documents %}{% for c in d.content %}{{ c }}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
            "not {% a template",
        ] {
            assert_eq!(detect(t), ContentFormat::String, "{t}");
        }
    }

    #[test]
    fn openai_templates() {
        for t in [
            "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}",
            "{% for m in messages[1:] %}{% for c in m.content | selectattr('type', 'eq', 'text') %}{% endfor %}{% endfor %}",
            "{% set ms = messages %}{% set rest = ms[1:] %}{% for m in rest %}{% for c in m.content %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% set parts = m.content %}{% for c in parts %}{% endfor %}{% endfor %}",
            "{% macro show(parts) %}{% for c in parts %}{{ c.text }}{% endfor %}{% endmacro %}\
             {% for m in messages %}{{ show(m.content) }}{% endfor %}",
            "{% for c in content %}{{ c }}{% endfor %}",
            // Prints strings and also iterates lists: still openai.
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}\
             {% for c in m.content %}{{ c.text }}{% endfor %}{% endif %}{% endfor %}",
        ] {
            assert_eq!(detect(t), ContentFormat::Openai, "{t}");
        }
    }

    #[test]
    fn qwen3_is_string_and_settings_override() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap()).unwrap();
        let template = config["chat_template"].as_str().unwrap();
        assert_eq!(ContentFormat::Auto.resolve(template), ContentFormat::String);
        assert_eq!(ContentFormat::Openai.resolve(template), ContentFormat::Openai);
    }
}
