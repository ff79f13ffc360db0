//! Helpers for chat requests and responses: message content, reasoning and
//! tool calls.

pub mod content;
pub mod reasoning;
pub mod tool_calls;
