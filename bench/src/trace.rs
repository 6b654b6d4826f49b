//! Request traces: JSONL files of sessions and turns with arrival times, written by
//! `gen-trace` from the simulator's workloads and fired at a live gateway by `replay`.
//!
//! One line per request, fields in this order:
//!
//! ```text
//! {"session":"mt-3","turn":2,"at_ms":154.210,"body":{"model":"sim","messages":[..],..}}
//! ```
//!
//! - `session`: the conversation (sent as `X-Session-ID`); a string, or a number.
//! - `turn`: its position in the session; a turn is sent only after the session's
//!   previous turn has completed.
//! - `at_ms`: the earliest time to send it, in ms from the start of the replay.
//! - `body`: the whole OpenAI chat request, sent byte for byte.
//!
//! `gen-trace` lays the requests out in the order the simulator issues them first
//! (`docs` in request order, `multiturn` turn by turn across sessions) and spaces them
//! as a Poisson process of `rate` requests per second (`rate` 0: all at 0 ms, so only
//! replay's concurrency and the turn order pace them).

use std::fmt::Write as _;

use crate::json;
use crate::sim::workload::Session;
use crate::workload::mix;

#[derive(Clone, Debug, PartialEq)]
pub struct TraceLine {
    pub session: String,
    pub turn: u64,
    pub at_ms: f64,
    pub body: String,
}

const TAG_ARRIVAL: u64 = 0xA77;

/// The trace of `sessions`: turn-major order, Poisson arrivals at `rate` per second.
pub fn generate(sessions: &[Session], rate: f64, seed: u64) -> Vec<TraceLine> {
    let max_turns = sessions.iter().map(|s| s.turns.len()).max().unwrap_or(0);
    let mut rng = fastrand::Rng::with_seed(mix(&[seed, TAG_ARRIVAL]));
    let mut at = 0.0f64;
    let mut lines = Vec::new();
    for t in 0..max_turns {
        for s in sessions {
            let Some(chat) = s.turns.get(t) else { continue };
            lines.push(TraceLine {
                session: s.name.clone(),
                turn: t as u64,
                at_ms: at,
                body: chat.to_json(),
            });
            if rate > 0.0 {
                at += -(1.0 - rng.f64()).ln() * 1000.0 / rate;
            }
        }
    }
    lines
}

impl TraceLine {
    pub fn to_json(&self) -> String {
        let mut s = String::with_capacity(self.body.len() + 64);
        s.push_str("{\"session\":");
        json::push_str(&mut s, &self.session);
        let _ = write!(
            s,
            ",\"turn\":{},\"at_ms\":{:.3},\"body\":{}}}",
            self.turn, self.at_ms, self.body
        );
        s
    }

    /// Parses one line; the fields may come in any order, unknown ones are ignored.
    pub fn parse(line: &str) -> Result<TraceLine, String> {
        let mut session = None;
        let mut turn = None;
        let mut at_ms = None;
        let mut body = None;
        for (key, raw) in json::top_level_fields(line)? {
            match key.as_str() {
                "session" => {
                    session = Some(if let Some(inner) = raw.strip_prefix('"') {
                        json::unescape(inner.strip_suffix('"').unwrap_or(inner))?
                    } else {
                        raw.parse::<u64>()
                            .map_err(|_| "`session` must be a string or a number")?
                            .to_string()
                    })
                }
                "turn" => turn = Some(raw.parse::<u64>().map_err(|_| "bad `turn`")?),
                "at_ms" => {
                    let v = raw.parse::<f64>().map_err(|_| "bad `at_ms`")?;
                    if !(v.is_finite() && v >= 0.0) {
                        return Err("`at_ms` must be a non-negative number".into());
                    }
                    at_ms = Some(v);
                }
                "body" => {
                    if !raw.starts_with('{') {
                        return Err("`body` must be a JSON object".into());
                    }
                    body = Some(raw.to_string());
                }
                _ => {}
            }
        }
        Ok(TraceLine {
            session: session.ok_or("missing `session`")?,
            turn: turn.unwrap_or(0),
            at_ms: at_ms.unwrap_or(0.0),
            body: body.ok_or("missing `body`")?,
        })
    }
}

/// Every non-blank line of a JSONL trace; errors name the line.
pub fn parse(text: &str) -> Result<Vec<TraceLine>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| TraceLine::parse(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::workload::{self, DocsConfig, MultiturnConfig, WorkloadSpec};

    #[test]
    fn generated_lines_round_trip() {
        let spec = WorkloadSpec::Multiturn(MultiturnConfig {
            sessions: 3,
            turns: 2,
            ..MultiturnConfig::default()
        });
        let sessions = workload::build(&spec, 1, "sim", 8);
        let lines = generate(&sessions, 100.0, 1);
        assert_eq!(lines.len(), 6);
        let order: Vec<(&str, u64)> = lines.iter().map(|l| (l.session.as_str(), l.turn)).collect();
        assert_eq!(
            order,
            [
                ("mt-0", 0),
                ("mt-1", 0),
                ("mt-2", 0),
                ("mt-0", 1),
                ("mt-1", 1),
                ("mt-2", 1)
            ]
        );
        assert!(lines.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert_eq!(lines[0].at_ms, 0.0);
        let text: String = lines.iter().map(|l| l.to_json() + "\n").collect();
        let parsed = parse(&text).unwrap();
        for (a, b) in lines.iter().zip(&parsed) {
            assert_eq!((&a.session, a.turn, &a.body), (&b.session, b.turn, &b.body));
            assert!((a.at_ms - b.at_ms).abs() < 1e-3);
        }
        assert_eq!(parsed[3].body, sessions[0].turns[1].to_json());
    }

    #[test]
    fn rate_zero_sends_everything_at_once() {
        let spec = WorkloadSpec::Docs(DocsConfig {
            requests: 5,
            ..DocsConfig::default()
        });
        let lines = generate(&workload::build(&spec, 1, "sim", 8), 0.0, 1);
        assert!(lines.iter().all(|l| l.at_ms == 0.0 && l.turn == 0));
        assert_eq!(lines[4].session, "docs-4");
    }

    #[test]
    fn parse_errors_name_the_line() {
        assert!(TraceLine::parse(r#"{"session":7,"body":{}}"#).is_ok());
        let err = parse("{\"session\":\"a\",\"body\":{}}\n\n{\"session\":\"a\"}\n").unwrap_err();
        assert!(err.starts_with("line 3:"), "{err}");
        assert!(TraceLine::parse(r#"{"session":"a","at_ms":-1,"body":{}}"#).is_err());
        assert!(TraceLine::parse(r#"{"session":"a","body":[]}"#).is_err());
    }
}
