//! OpenAI message content as one string. Content is either a string or a
//! list of typed parts; pyserve serves text models, so the text parts are
//! joined and any other part (an image, audio) is an error for the client,
//! rather than being dropped without a word.

/// One entry of a content list: its `type` and, for text parts, its `text`.
pub struct Part<'a> {
    pub kind: &'a str,
    pub text: Option<&'a str>,
}

/// Joins the text parts with newlines, as chat templates that take a plain
/// string expect; empty text parts are skipped.
pub fn join_parts(parts: &[Part<'_>]) -> Result<String, String> {
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match (part.kind, part.text) {
            ("text", Some(text)) => texts.push(text),
            ("text", None) => return Err("a content part of type 'text' needs a 'text' string".into()),
            (kind, _) => return Err(format!("content parts of type '{kind}' are not supported: text only")),
        }
    }
    texts.retain(|t| !t.is_empty());
    Ok(texts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &str) -> Part<'_> {
        Part { kind: "text", text: Some(t) }
    }

    #[test]
    fn joins_text_parts() {
        assert_eq!(join_parts(&[text("a"), text(""), text("b")]).unwrap(), "a\nb");
        assert_eq!(join_parts(&[]).unwrap(), "");
    }

    #[test]
    fn other_parts_are_errors() {
        let image = Part { kind: "image_url", text: None };
        assert!(join_parts(&[text("a"), image]).unwrap_err().contains("image_url"));
        assert!(join_parts(&[Part { kind: "text", text: None }]).is_err());
    }
}
