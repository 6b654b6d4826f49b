//! `[workflows]`: the limits of `POST /v1/workflows` (wire struct and validation).

use radixgate_orchestrator::dag::DagLimits;
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct WorkflowsWire {
    /// Most nodes one workflow may hold (400 beyond).
    max_nodes: usize,
    /// Most children one node may have (400 beyond).
    max_fan_out: usize,
    /// Largest response body one node may return, in bytes (the node fails beyond).
    max_node_response_bytes: usize,
}

impl Default for WorkflowsWire {
    fn default() -> Self {
        Self {
            max_nodes: 64,
            max_fan_out: 32,
            max_node_response_bytes: 1 << 20,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkflowsConfig {
    pub limits: DagLimits,
    pub max_node_response_bytes: usize,
}

pub(super) fn validate(w: WorkflowsWire, errors: &mut Vec<String>) -> WorkflowsConfig {
    for (value, key) in [
        (w.max_nodes, "workflows.max_nodes"),
        (w.max_fan_out, "workflows.max_fan_out"),
        (
            w.max_node_response_bytes,
            "workflows.max_node_response_bytes",
        ),
    ] {
        if value == 0 {
            errors.push(format!("{key}: must be at least 1"));
        }
    }
    WorkflowsConfig {
        limits: DagLimits {
            max_nodes: w.max_nodes,
            max_fan_out: w.max_fan_out,
        },
        max_node_response_bytes: w.max_node_response_bytes,
    }
}
