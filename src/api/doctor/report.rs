//! What the doctor found: sections of facts, and problems, each with the
//! option to change. Printed as text for a person, or as JSON for a
//! program (the Python doctor, the tests).

/// One problem and what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub problem: String,
    /// The option or variable to set, and to what.
    pub change: String,
}

/// One section's facts: `(name, value)` pairs kept for JSON, rendered as
/// lines.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Section {
    pub name: String,
    pub facts: Vec<(String, Fact)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Fact {
    Text(String),
    Bool(bool),
    Number(f64),
    List(Vec<String>),
    /// Nested: one object per entry (peers).
    Objects(Vec<Vec<(String, Fact)>>),
}

impl Section {
    pub fn new(name: &str) -> Section {
        Section {
            name: name.to_string(),
            facts: Vec::new(),
        }
    }

    pub fn text(&mut self, key: &str, value: impl Into<String>) -> &mut Section {
        self.facts.push((key.to_string(), Fact::Text(value.into())));
        self
    }

    pub fn flag(&mut self, key: &str, value: bool) -> &mut Section {
        self.facts.push((key.to_string(), Fact::Bool(value)));
        self
    }

    pub fn number(&mut self, key: &str, value: f64) -> &mut Section {
        self.facts.push((key.to_string(), Fact::Number(value)));
        self
    }

    pub fn list(&mut self, key: &str, value: Vec<String>) -> &mut Section {
        self.facts.push((key.to_string(), Fact::List(value)));
        self
    }

    pub fn objects(&mut self, key: &str, value: Vec<Vec<(String, Fact)>>) -> &mut Section {
        self.facts.push((key.to_string(), Fact::Objects(value)));
        self
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub sections: Vec<Section>,
    pub problems: Vec<Problem>,
    /// Lines for a person, section by section, as they were found.
    pub lines: Vec<String>,
}

impl Report {
    pub fn say(&mut self, line: impl Into<String>) {
        self.lines.push(line.into());
    }

    pub fn problem(&mut self, problem: impl Into<String>, change: impl Into<String>) {
        self.problems.push(Problem {
            problem: problem.into(),
            change: change.into(),
        });
    }

    pub fn add(&mut self, section: Section) {
        self.sections.push(section);
    }

    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// The report for a person: what was found, then each problem with what
    /// to change, then the verdict.
    pub fn text(&self) -> String {
        let mut out = String::from("pjrt-crosshost doctor\n");
        for line in &self.lines {
            out.push_str(line);
            out.push('\n');
        }
        if self.problems.is_empty() {
            out.push_str("\nno problem found\n");
        } else {
            out.push_str(&format!("\n{} problem(s):\n", self.problems.len()));
            for (i, p) in self.problems.iter().enumerate() {
                out.push_str(&format!(
                    "  {}. {}\n     change: {}\n",
                    i + 1,
                    p.problem,
                    p.change
                ));
            }
        }
        out
    }

    /// `{"ok": ..., "problems": [{"problem", "change"}], "<section>": {...}, "text": ...}`.
    pub fn json(&self) -> String {
        let mut out = format!("{{\"ok\":{},\"problems\":[", self.ok());
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&format!(
                "{{\"problem\":{},\"change\":{}}}",
                quote(&p.problem),
                quote(&p.change)
            ));
        }
        out.push(']');
        for section in &self.sections {
            out.push_str(&format!(",{}:", quote(&section.name)));
            object(&mut out, &section.facts);
        }
        out.push_str(&format!(",\"text\":{}}}", quote(&self.text())));
        out
    }
}

fn object(out: &mut String, facts: &[(String, Fact)]) {
    out.push('{');
    for (i, (key, fact)) in facts.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&quote(key));
        out.push(':');
        match fact {
            Fact::Text(t) => out.push_str(&quote(t)),
            Fact::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Fact::Number(n) if n.is_finite() => out.push_str(&format!("{n}")),
            Fact::Number(_) => out.push_str("null"),
            Fact::List(items) => {
                out.push('[');
                out.push_str(&items.iter().map(|t| quote(t)).collect::<Vec<_>>().join(","));
                out.push(']');
            }
            Fact::Objects(entries) => {
                out.push('[');
                for (j, entry) in entries.iter().enumerate() {
                    if j > 0 {
                        out.push(',');
                    }
                    object(out, entry);
                }
                out.push(']');
            }
        }
    }
    out.push('}');
}

/// A JSON string.
pub fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_carries_the_sections_the_problems_and_the_text() {
        let mut report = Report::default();
        let mut ucx = Section::new("ucx");
        ucx.text("path", "/x/\"libucp\".so")
            .flag("rdma", false)
            .number("rtt_ms", 0.25)
            .list("transports", vec!["tcp".into(), "self".into()]);
        report.add(ucx);
        report.say("UCX  1.22.0");
        report.problem("no UCX", "ucx_library=<path>");
        let json = report.json();
        assert!(json.starts_with("{\"ok\":false,\"problems\":[{\"problem\":\"no UCX\",\"change\":\"ucx_library=<path>\"}]"), "{json}");
        assert!(json.contains("\"ucx\":{\"path\":\"/x/\\\"libucp\\\".so\",\"rdma\":false,\"rtt_ms\":0.25,\"transports\":[\"tcp\",\"self\"]}"), "{json}");
        assert!(json.contains("\"text\":\"pjrt-crosshost doctor\\nUCX  1.22.0\\n\\n1 problem(s):\\n  1. no UCX\\n     change: ucx_library=<path>\\n\""), "{json}");
        assert!(Report::default().text().ends_with("no problem found\n"));
    }
}
