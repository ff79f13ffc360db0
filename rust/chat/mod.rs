//! Helpers for chat requests and responses: message content and reasoning.

pub mod content;
pub mod reasoning;
