//! Workflow DAGs: validation, execution order, failure propagation and parent-output
//! references, decided before anything runs.
//!
//! The gateway's `POST /v1/workflows` parses the request's nodes (each an LLM call
//! with an `id`, `parents` and a prompt that may say `{{parent_id}}` where a parent's
//! output goes) and asks [`plan`] for a [`Plan`]: every error a request can hold — a
//! duplicate id, an unknown parent, a reference to a node that is not a parent, a
//! cycle, too many nodes or too wide a fan-out — comes back at once as a
//! [`DagError`] before any node is sent. The gateway then runs the plan: a node starts
//! as soon as all its parents succeeded ([`Plan::ready`]), siblings run in parallel,
//! each is routed like any request (so the prefix index places it next to the
//! prefixes it shares with its parents and siblings), and a failed node fails exactly
//! its descendants ([`Plan::descendants`]).

use std::collections::HashMap;
use std::fmt;

/// Request-size limits (`[workflows]` in the gateway's config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DagLimits {
    pub max_nodes: usize,
    /// Most children one node may have.
    pub max_fan_out: usize,
}

/// One node as the request gave it: its id, its parents' ids, and the ids its prompt
/// references.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSpec<'a> {
    pub id: &'a str,
    pub parents: Vec<&'a str>,
    pub references: Vec<&'a str>,
}

/// What is wrong with a workflow; `at` is the offending node's position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DagError {
    TooManyNodes {
        nodes: usize,
        max: usize,
    },
    Empty,
    DuplicateId {
        at: usize,
        id: String,
    },
    UnknownParent {
        at: usize,
        parent: String,
    },
    /// A `{{id}}` in a node's prompt names a node that is not one of its parents.
    NotAParent {
        at: usize,
        reference: String,
    },
    FanOut {
        at: usize,
        children: usize,
        max: usize,
    },
    /// The nodes on a cycle, in the request's order.
    Cycle {
        ids: Vec<String>,
    },
}

impl DagError {
    /// The node position the error is about, if it is about one.
    pub fn node(&self) -> Option<usize> {
        match self {
            DagError::DuplicateId { at, .. }
            | DagError::UnknownParent { at, .. }
            | DagError::NotAParent { at, .. }
            | DagError::FanOut { at, .. } => Some(*at),
            _ => None,
        }
    }
}

impl fmt::Display for DagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DagError::TooManyNodes { nodes, max } => {
                write!(f, "the workflow has {nodes} nodes; at most {max} are allowed")
            }
            DagError::Empty => f.write_str("the workflow has no nodes"),
            DagError::DuplicateId { id, .. } => write!(f, "node id `{id}` is used twice"),
            DagError::UnknownParent { parent, .. } => {
                write!(f, "parent `{parent}` is not a node of this workflow")
            }
            DagError::NotAParent { reference, .. } => write!(
                f,
                "the prompt references `{{{{{reference}}}}}`, which is not one of the node's parents"
            ),
            DagError::FanOut { children, max, .. } => {
                write!(f, "the node has {children} children; at most {max} are allowed")
            }
            DagError::Cycle { ids } => write!(f, "the workflow has a cycle through {}", ids.join(", ")),
        }
    }
}

/// A valid workflow, by node position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub parents: Vec<Vec<usize>>,
    pub children: Vec<Vec<usize>>,
    /// A topological order (parents before children; ties in request order).
    pub order: Vec<usize>,
}

/// Validates `nodes` and builds their [`Plan`].
pub fn plan(nodes: &[NodeSpec<'_>], limits: DagLimits) -> Result<Plan, DagError> {
    if nodes.is_empty() {
        return Err(DagError::Empty);
    }
    if nodes.len() > limits.max_nodes {
        return Err(DagError::TooManyNodes {
            nodes: nodes.len(),
            max: limits.max_nodes,
        });
    }
    let mut by_id: HashMap<&str, usize> = HashMap::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        if by_id.insert(n.id, i).is_some() {
            return Err(DagError::DuplicateId {
                at: i,
                id: n.id.to_owned(),
            });
        }
    }
    let mut parents = vec![Vec::new(); nodes.len()];
    let mut children = vec![Vec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        for p in &n.parents {
            let &j = by_id.get(p).ok_or_else(|| DagError::UnknownParent {
                at: i,
                parent: (*p).to_owned(),
            })?;
            if !parents[i].contains(&j) {
                parents[i].push(j);
                children[j].push(i);
            }
        }
        if let Some(r) = n.references.iter().find(|r| !n.parents.contains(r)) {
            return Err(DagError::NotAParent {
                at: i,
                reference: (*r).to_owned(),
            });
        }
    }
    if let Some((at, c)) = children
        .iter()
        .enumerate()
        .find(|(_, c)| c.len() > limits.max_fan_out)
    {
        return Err(DagError::FanOut {
            at,
            children: c.len(),
            max: limits.max_fan_out,
        });
    }
    // Kahn's algorithm, ready nodes taken in request order.
    let mut waiting: Vec<usize> = parents.iter().map(Vec::len).collect();
    let mut ready: std::collections::BTreeSet<usize> =
        (0..nodes.len()).filter(|&i| waiting[i] == 0).collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(i) = ready.pop_first() {
        order.push(i);
        for &c in &children[i] {
            waiting[c] -= 1;
            if waiting[c] == 0 {
                ready.insert(c);
            }
        }
    }
    if order.len() < nodes.len() {
        let ids = (0..nodes.len())
            .filter(|&i| waiting[i] > 0)
            .map(|i| nodes[i].id.to_owned())
            .collect();
        return Err(DagError::Cycle { ids });
    }
    Ok(Plan {
        parents,
        children,
        order,
    })
}

/// A node's state while the workflow runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    Waiting,
    Running,
    Succeeded,
    /// It failed, or a parent did.
    Failed,
}

impl Plan {
    /// Nodes that may start now: waiting, with every parent succeeded.
    pub fn ready<'s>(&'s self, states: &'s [NodeState]) -> impl Iterator<Item = usize> + 's {
        self.order.iter().copied().filter(move |&i| {
            states[i] == NodeState::Waiting
                && self.parents[i]
                    .iter()
                    .all(|&p| states[p] == NodeState::Succeeded)
        })
    }

    /// Every node downstream of `node`, in topological order.
    pub fn descendants(&self, node: usize) -> Vec<usize> {
        let mut seen = vec![false; self.parents.len()];
        let mut stack = vec![node];
        while let Some(n) = stack.pop() {
            for &c in &self.children[n] {
                if !seen[c] {
                    seen[c] = true;
                    stack.push(c);
                }
            }
        }
        self.order.iter().copied().filter(|&i| seen[i]).collect()
    }
}

/// Characters a node id may hold (so a `{{id}}` reference is unambiguous).
pub fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.')
}

/// The `{{id}}` references in `text` (ids as [`is_valid_id`] allows; other `{{...}}`
/// text is left alone).
pub fn references(text: &str) -> impl Iterator<Item = &str> {
    Segments { rest: text }.filter_map(|s| match s {
        Segment::Reference(id) => Some(id),
        Segment::Text(_) => None,
    })
}

/// `text` with every `{{id}}` replaced by what `output(id)` writes into `out`.
pub fn render(text: &str, out: &mut String, mut output: impl FnMut(&str, &mut String)) {
    for s in (Segments { rest: text }) {
        match s {
            Segment::Text(t) => out.push_str(t),
            Segment::Reference(id) => output(id, out),
        }
    }
}

enum Segment<'a> {
    Text(&'a str),
    Reference(&'a str),
}

struct Segments<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Segments<'a> {
    type Item = Segment<'a>;

    fn next(&mut self) -> Option<Segment<'a>> {
        if self.rest.is_empty() {
            return None;
        }
        let mut from = 0;
        while let Some(open) = self.rest[from..].find("{{").map(|o| o + from) {
            let inner = &self.rest[open + 2..];
            if let Some(close) = inner.find("}}") {
                let id = &inner[..close];
                if is_valid_id(id) {
                    if open > 0 {
                        let text = &self.rest[..open];
                        self.rest = &self.rest[open..];
                        return Some(Segment::Text(text));
                    }
                    self.rest = &inner[close + 2..];
                    return Some(Segment::Reference(id));
                }
            }
            from = open + 2;
        }
        let text = self.rest;
        self.rest = "";
        Some(Segment::Text(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: DagLimits = DagLimits {
        max_nodes: 8,
        max_fan_out: 3,
    };

    fn node<'a>(id: &'a str, parents: &[&'a str]) -> NodeSpec<'a> {
        NodeSpec {
            id,
            parents: parents.to_vec(),
            references: Vec::new(),
        }
    }

    #[test]
    fn map_reduce_orders_parents_first_and_fails_descendants() {
        let nodes = [
            node("reduce", &["m1", "m2"]),
            node("m1", &["split"]),
            node("split", &[]),
            node("m2", &["split"]),
            node("other", &[]),
        ];
        let p = plan(&nodes, LIMITS).unwrap();
        assert_eq!(p.order, vec![2, 1, 3, 0, 4]);
        let mut states = vec![NodeState::Waiting; 5];
        assert_eq!(p.ready(&states).collect::<Vec<_>>(), vec![2, 4]);
        states[2] = NodeState::Succeeded;
        assert_eq!(p.ready(&states).collect::<Vec<_>>(), vec![1, 3, 4]);
        states[1] = NodeState::Succeeded;
        assert_eq!(p.ready(&states).collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(p.descendants(2), vec![1, 3, 0]);
        assert_eq!(p.descendants(3), vec![0]);
        assert!(p.descendants(4).is_empty());
    }

    #[test]
    fn every_error_is_found_before_running() {
        let e = plan(&[node("a", &[]), node("a", &[])], LIMITS).unwrap_err();
        assert_eq!(
            e,
            DagError::DuplicateId {
                at: 1,
                id: "a".into()
            }
        );
        let e = plan(&[node("a", &["x"])], LIMITS).unwrap_err();
        assert_eq!(e.node(), Some(0));
        assert!(e.to_string().contains("`x`"), "{e}");
        let e = plan(
            &[
                node("a", &["c"]),
                node("b", &["a"]),
                node("c", &["b"]),
                node("d", &[]),
            ],
            LIMITS,
        )
        .unwrap_err();
        assert_eq!(
            e,
            DagError::Cycle {
                ids: vec!["a".into(), "b".into(), "c".into()]
            }
        );
        assert!(matches!(
            plan(&[node("a", &["a"])], LIMITS).unwrap_err(),
            DagError::Cycle { .. }
        ));
        let many: Vec<_> = (0..9).map(|_| node("x", &[])).collect();
        assert!(matches!(
            plan(&many, LIMITS).unwrap_err(),
            DagError::TooManyNodes { nodes: 9, max: 8 }
        ));
        let fan = [
            node("r", &[]),
            node("a", &["r"]),
            node("b", &["r"]),
            node("c", &["r"]),
            node("d", &["r"]),
        ];
        assert!(matches!(
            plan(&fan, LIMITS).unwrap_err(),
            DagError::FanOut {
                at: 0,
                children: 4,
                max: 3
            }
        ));
        let mut bad_ref = node("b", &["a"]);
        bad_ref.references = vec!["a", "z"];
        let e = plan(&[node("a", &[]), bad_ref], LIMITS).unwrap_err();
        assert_eq!(
            e,
            DagError::NotAParent {
                at: 1,
                reference: "z".into()
            }
        );
        assert_eq!(plan(&[], LIMITS).unwrap_err(), DagError::Empty);
    }

    #[test]
    fn references_render_in_place() {
        let t = "Summaries: {{m1}} and {{m-2}}; keep {{not an id}} and {{}} and {{m1";
        assert_eq!(references(t).collect::<Vec<_>>(), vec!["m1", "m-2"]);
        let mut out = String::new();
        render(t, &mut out, |id, out| out.push_str(&id.to_uppercase()));
        assert_eq!(
            out,
            "Summaries: M1 and M-2; keep {{not an id}} and {{}} and {{m1"
        );
        let mut out = String::new();
        render("{{a}}{{b}}", &mut out, |id, out| out.push_str(id));
        assert_eq!(out, "ab");
        assert!(!is_valid_id("a b") && is_valid_id("step_1.x"));
    }
}
