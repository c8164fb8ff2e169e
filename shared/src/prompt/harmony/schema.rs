//! A function tool's JSON-schema parameters as the TypeScript-like type harmony prints in the
//! developer message (openai-harmony's `json_schema_to_typescript`, which vLLM 0.32 runs).
//!
//! The rules, each visible in the prompt:
//! - `oneOf` (a list) at the top is one `\n{indent} | variant` line per variant, each with a
//!   trailing `// description default: …` comment;
//! - `type` as a list is its names joined with `" | "` (`integer` → `number`);
//! - objects open on `{` (after a `// description` line), give each property its `title`,
//!   `description` and `examples` as comments, `key?:` unless required, and a trailing
//!   `// default: …`; a property with a `oneOf` list prints its variants on lines of their own;
//! - string enums are their quoted values joined with `" | "`; arrays are `items[]`, or
//!   `Array<any>` without `items`; anything else is `any`;
//! - `nullable: true` adds `| null` where the type does not say `null` already.
//!
//! Properties keep the order the client sent them in.

use serde_json::Value;

/// The type of `schema`, its nested lines indented by `indent`.
pub fn typescript(schema: &Value, indent: &str) -> String {
    if let Some(variants) = schema.get("oneOf").and_then(Value::as_array) {
        return variants
            .iter()
            .map(|variant| {
                let mut line = format!("\n{indent} | {}", nullable(variant, &format!("{indent}   ")));
                line.push_str(&trailing_comment(variant, text(variant, "description"), DefaultStyle::JsonForEnums));
                line
            })
            .collect();
    }
    if let Some(types) = schema.get("type").and_then(Value::as_array) {
        let names: Vec<&str> = types.iter().filter_map(Value::as_str).map(number_for_integer).collect();
        if !names.is_empty() {
            return names.join(" | ");
        }
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => object(schema, indent),
        Some("string") => {
            let values: Vec<String> = schema
                .get("enum")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(|s| format!("\"{s}\""))
                .collect();
            if values.is_empty() {
                "string".into()
            } else {
                values.join(" | ")
            }
        }
        Some("number" | "integer") => "number".into(),
        Some("boolean") => "boolean".into(),
        Some("array") => match schema.get("items") {
            Some(items) => format!("{}[]", typescript(items, indent)),
            None => "Array<any>".into(),
        },
        _ => "any".into(),
    }
}

fn number_for_integer(name: &str) -> &str {
    match name {
        "integer" => "number",
        other => other,
    }
}

/// The type, with `| null` added for a `nullable` schema whose type does not say `null`.
fn nullable(schema: &Value, indent: &str) -> String {
    let mut ty = typescript(schema, indent);
    if schema.get("nullable").and_then(Value::as_bool) == Some(true) && !ty.contains("null") {
        ty.push_str(" | null");
    }
    ty
}

fn is_enum(schema: &Value) -> bool {
    schema.get("enum").and_then(Value::as_array).is_some_and(|values| !values.is_empty())
}

fn text<'a>(schema: &'a Value, key: &str) -> Option<&'a str> {
    schema.get(key).and_then(Value::as_str)
}

/// How a string `default` is printed: always quoted unless the schema is an enum, then either
/// bare (properties) or as JSON (top-level `oneOf` variants).
#[derive(Clone, Copy)]
enum DefaultStyle {
    BareForEnums,
    JsonForEnums,
}

fn default_text(schema: &Value, style: DefaultStyle) -> Option<String> {
    let default = schema.get("default")?;
    Some(match (default.as_str(), is_enum(schema), style) {
        (Some(s), false, _) => format!("default: \"{s}\""),
        (Some(s), true, DefaultStyle::BareForEnums) => format!("default: {s}"),
        _ => format!("default: {default}"),
    })
}

/// ` // description default: …` after a variant's type (empty without either).
fn trailing_comment(variant: &Value, description: Option<&str>, style: DefaultStyle) -> String {
    let comments: Vec<String> =
        description.map(str::to_owned).into_iter().chain(default_text(variant, style)).collect();
    match comments.is_empty() {
        true => String::new(),
        false => format!(" // {}", comments.join(" ")),
    }
}

fn object(schema: &Value, indent: &str) -> String {
    let mut out = String::new();
    if let Some(description) = text(schema, "description") {
        out.push_str(&format!("{indent}// {description}\n"));
    }
    out.push_str("{\n");
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        let required: Vec<&str> =
            schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        for (key, property) in properties {
            let optional = if required.contains(&key.as_str()) { "" } else { "?" };
            out.push_str(&property_comments(property, indent));
            match property.get("oneOf").and_then(Value::as_array) {
                Some(variants) => out.push_str(&one_of_property(key, optional, property, variants, indent)),
                None => out.push_str(&plain_property(key, optional, property, indent)),
            }
        }
    }
    out.push_str(&format!("{indent}}}"));
    out
}

/// The comment lines above a property: its title, its description (unless it has a `oneOf`,
/// which places its own), its examples.
fn property_comments(property: &Value, indent: &str) -> String {
    let mut out = String::new();
    if let Some(title) = text(property, "title") {
        out.push_str(&format!("{indent}// {title}\n{indent}//\n"));
    }
    if property.get("oneOf").is_none() {
        if let Some(description) = text(property, "description") {
            out.push_str(&format!("{indent}// {description}\n"));
        }
    }
    let examples = property.get("examples").and_then(Value::as_array).filter(|e| !e.is_empty());
    if let Some(examples) = examples {
        out.push_str(&format!("{indent}// Examples:\n"));
        for example in examples.iter().filter_map(Value::as_str) {
            out.push_str(&format!("{indent}// - \"{example}\"\n"));
        }
    }
    out
}

fn plain_property(key: &str, optional: &str, property: &Value, indent: &str) -> String {
    let mut out = format!("{indent}{key}{optional}: {},", nullable(property, &format!("{indent}    ")));
    if property.get("oneOf").is_none() {
        if let Some(default) = default_text(property, DefaultStyle::BareForEnums) {
            out.push_str(&format!(" // {default}"));
        }
    }
    out.push('\n');
    out
}

/// A property whose `oneOf` is a list: its description above it (unless the first variant
/// says the same), its default, then one line per variant.
fn one_of_property(key: &str, optional: &str, property: &Value, variants: &[Value], indent: &str) -> String {
    let mut out = String::new();
    let description = text(property, "description");
    let first_says_it = description.is_some() && variants.first().and_then(|v| text(v, "description")) == description;
    let said_above = description.is_some() && !first_says_it;
    if let (Some(description), true) = (description, said_above) {
        out.push_str(&format!("{indent}// {description}\n"));
    }
    if let Some(default) = default_text(property, DefaultStyle::BareForEnums) {
        out.push_str(&format!("{indent}// {default}\n"));
    }
    out.push_str(&format!("{indent}{key}{optional}:\n"));
    for (i, variant) in variants.iter().enumerate() {
        out.push_str(&format!("{indent} | {}", nullable(variant, &format!("{indent}   "))));
        // The first variant's description is left out when the property's was said above;
        // any variant's, when it repeats the property's.
        let own = text(variant, "description").filter(|d| !(i == 0 && said_above) && Some(*d) != description);
        let comment = trailing_comment(variant, own, DefaultStyle::BareForEnums);
        out.push_str(&comment);
        out.push('\n');
    }
    out.push_str(&format!("{indent},\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_print_comments_optional_marks_and_defaults() {
        let schema = json!({"type": "object", "description": "Args.", "properties": {
            "b": {"type": "string", "enum": ["x", "y"], "default": "x", "description": "Pick."},
            "a": {"type": "integer", "default": 2},
            "c": {"type": "string", "default": "q", "examples": ["e1"]}}, "required": ["a"]});
        assert_eq!(
            typescript(&schema, ""),
            "// Args.\n{\n// Pick.\nb?: \"x\" | \"y\", // default: x\na: number, // default: 2\n\
             // Examples:\n// - \"e1\"\nc?: string, // default: \"q\"\n}"
        );
    }

    #[test]
    fn one_of_properties_print_a_line_per_variant() {
        let schema = json!({"type": "object", "properties": {"u": {"description": "Unit.", "default": 1, "oneOf": [
            {"type": "number", "description": "First.", "default": 0},
            {"type": "string", "nullable": true, "description": "Unit."}]}}});
        assert_eq!(
            typescript(&schema, ""),
            "{\n// Unit.\n// default: 1\nu?:\n | number // default: 0\n | string | null\n,\n}"
        );
    }

    #[test]
    fn shapes_without_a_known_type_are_any() {
        assert_eq!(typescript(&json!({}), ""), "any");
        assert_eq!(typescript(&json!({"type": "array"}), ""), "Array<any>");
        assert_eq!(typescript(&json!({"type": ["integer", "null"]}), ""), "number | null");
        assert_eq!(
            typescript(&json!({"oneOf": [{"type": "boolean", "default": "d", "enum": ["d"]}]}), "  "),
            "\n   | boolean // default: \"d\""
        );
    }
}
