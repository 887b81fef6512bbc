//! Counterexamples as Mermaid sequence diagrams.
//!
//! A model's [`crate::Explain::arrow`] turns each action of a path into a [`Arrow`] between
//! two of its [`crate::Explain::participants`]; [`mermaid`] renders the steps as a
//! `sequenceDiagram` that GitHub, GitLab and mermaid.live draw.

use core::fmt::Write as _;

/// One action of a path as an arrow of a sequence diagram.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct Arrow {
    /// The acting participant (index into the model's participants).
    pub from: usize,
    /// The participant acted on; may equal `from` (a self-arrow).
    pub to: usize,
    /// The arrow's label: the action and what it produced, on one line.
    pub label: String,
    /// A note drawn right after the arrow, over both participants (an error, a fault, a
    /// violation).
    pub note: Option<String>,
}

impl Arrow {
    /// An arrow without a note.
    pub fn new(from: usize, to: usize, label: impl Into<String>) -> Self {
        Self {
            from,
            to,
            label: label.into(),
            note: None,
        }
    }

    /// The same arrow with `note`.
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}

/// Renders `steps` between `participants` as a Mermaid `sequenceDiagram`: one `participant` line
/// per participant (in order, with ids `p0`, `p1`, … and the names as aliases), one `->>` arrow
/// per step and a `Note over` line per note. Labels are escaped ([`escape_label`]). A step
/// naming a participant index past the list gets a participant named after the index.
pub fn mermaid(participants: &[String], steps: &[Arrow]) -> String {
    mermaid_with_final_note(participants, steps, None)
}

/// [`mermaid`] with a closing note over all participants (e.g. the property the path breaks).
pub(crate) fn mermaid_with_final_note(
    participants: &[String],
    steps: &[Arrow],
    final_note: Option<&str>,
) -> String {
    let count = steps
        .iter()
        .map(|s| s.from.max(s.to) + 1)
        .max()
        .unwrap_or(0)
        .max(participants.len());
    let mut out = String::from("sequenceDiagram\n");
    for i in 0..count {
        let name = participants
            .get(i)
            .cloned()
            .unwrap_or_else(|| format!("participant {i}"));
        let _ = writeln!(out, "    participant p{i} as {}", escape_label(&name));
    }
    for step in steps {
        let _ = writeln!(
            out,
            "    p{}->>p{}: {}",
            step.from,
            step.to,
            escape_label(&step.label)
        );
        if let Some(note) = &step.note {
            let over = if step.from == step.to {
                format!("p{}", step.from)
            } else {
                format!("p{},p{}", step.from, step.to)
            };
            let _ = writeln!(out, "    Note over {over}: {}", escape_label(note));
        }
    }
    if let (Some(note), true) = (final_note, count > 0) {
        let over = if count == 1 {
            "p0".to_owned()
        } else {
            format!("p0,p{}", count - 1)
        };
        let _ = writeln!(out, "    Note over {over}: {}", escape_label(note));
    }
    out
}

/// Escapes `text` for a Mermaid sequence-diagram label (message, note or participant alias).
///
/// Mermaid reads a message's text up to `;` (a statement separator), `#` (the start of an
/// entity code) or a line break, and its renderer treats `<`, `>` and `&` as HTML. Those become
/// Mermaid entity codes (`#59;`, `#35;`, `#lt;`, `#gt;`, `#amp;`), which render as the
/// characters themselves; `%` becomes `#37;` (a `%%` would start a comment or directive); line
/// breaks become `<br/>`. Leading and trailing whitespace is trimmed (Mermaid drops it), and an
/// empty label becomes a single space-free placeholder `-` so the line stays well-formed.
pub fn escape_label(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.trim().chars() {
        match c {
            '#' => out.push_str("#35;"),
            ';' => out.push_str("#59;"),
            '<' => out.push_str("#lt;"),
            '>' => out.push_str("#gt;"),
            '&' => out.push_str("#amp;"),
            '%' => out.push_str("#37;"),
            '\r' => {}
            '\n' => out.push_str("<br/>"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    if out.is_empty() {
        out.push('-');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_what_mermaid_cannot_take() {
        assert_eq!(escape_label("a; b # c"), "a#59; b #35; c");
        assert_eq!(escape_label("x <y> & 50%"), "x #lt;y#gt; #amp; 50#37;");
        assert_eq!(escape_label(" two\nlines \r"), "two<br/>lines");
        assert_eq!(escape_label(""), "-");
        assert_eq!(escape_label("{req-0,req-1} → ok"), "{req-0,req-1} → ok");
    }

    #[test]
    fn renders_participants_arrows_and_notes() {
        let participants = vec!["env".to_owned(), "rank 0".to_owned()];
        let steps = vec![
            Arrow::new(0, 1, "recv of req-0 completes"),
            Arrow::new(1, 1, "step; bad").with_note("protocol violation #1"),
            Arrow::new(1, 2, "to an unnamed participant"),
        ];
        let text = mermaid_with_final_note(&participants, &steps, Some("violated"));
        assert_eq!(
            text,
            "sequenceDiagram\n\
             \x20   participant p0 as env\n\
             \x20   participant p1 as rank 0\n\
             \x20   participant p2 as participant 2\n\
             \x20   p0->>p1: recv of req-0 completes\n\
             \x20   p1->>p1: step#59; bad\n\
             \x20   Note over p1: protocol violation #35;1\n\
             \x20   p1->>p2: to an unnamed participant\n\
             \x20   Note over p0,p2: violated\n"
        );
        assert_eq!(
            mermaid(&[], &[]),
            "sequenceDiagram\n",
            "no participants, no steps"
        );
    }
}
