//! Helpers for chat requests and responses: message content, reasoning and
//! tool calls, and gpt-oss's Harmony output, which carries both.

pub mod content;
pub mod harmony;
pub mod reasoning;
pub mod tool_calls;

/// Length in bytes of the longest tail of `text` that is a proper prefix of
/// `marker`: text a streaming parser must hold back, since the next delta
/// may complete the marker.
fn partial_marker_len(text: &str, marker: &str) -> usize {
    let shortest_start = text.len().saturating_sub(marker.len() - 1);
    (shortest_start..text.len())
        .filter(|&start| text.is_char_boundary(start))
        .map(|start| &text[start..])
        .find(|tail| marker.starts_with(tail))
        .map_or(0, str::len)
}
