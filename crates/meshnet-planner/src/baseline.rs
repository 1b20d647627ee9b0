//! A Petals-like placement, kept as a yardstick for the planner.
//!
//! Every server picks its own span greedily, as Petals' `choose_best_blocks`
//! does: among the windows of its length, it takes the one whose per-layer
//! throughputs, sorted ascending, are lexicographically smallest (so it always
//! targets the weakest layer first, then the next weakest, ...; leftmost on
//! ties). Afterwards each server in turn checks whether moving its whole span
//! to the window it would choose now raises the weakest layer's throughput
//! enough (`before < balance_quality × after`, with `balance_quality` 0.75 as
//! in Petals) and, if so, reloads its whole span there. There is no global
//! view: departures are repaired only by these local moves.
//!
//! One simplification against Petals: Petals' `should_choose_other_blocks`
//! judges a move after simulating the whole swarm settling (every other server
//! re-choosing its blocks until nobody moves); here a server judges only its
//! own move, with everybody else staying put. Moves that pay off only once
//! others follow are therefore not made. The simulation would cost
//! `O(servers² × layers²)` per check, too much to replay churn on large meshes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::ModelShape;

use crate::planner::scale_throughput;
use crate::types::{Directive, PeerCapacity};
use meshnet_types::Quantization;
use meshnet_types::{LayerSpan, PeerId};

/// One server of the baseline mesh.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineServer {
    /// Throughput in internal integer units.
    throughput: u64,
    /// Span length the server's memory allows.
    length: u32,
    /// Quantization it runs at that length.
    quantization: Quantization,
    /// Where it currently serves, if anywhere.
    span: Option<LayerSpan>,
}

/// The Petals-like mesh: the tracker's `[0..k)` plus self-placing servers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GreedyBaseline {
    num_layers: u32,
    tracker_layers: u32,
    balance_quality: f64,
    servers: BTreeMap<PeerId, BaselineServer>,
    counts: Vec<u32>,
    throughput: Vec<u64>,
}

impl GreedyBaseline {
    /// An empty baseline mesh for `model` where the tracker holds `[0..tracker_layers)`
    /// with `tracker_throughput` tokens/s.
    pub fn new(model: &ModelShape, tracker_layers: u32, tracker_throughput: f64) -> Self {
        let num_layers = model.num_layers;
        let tracker_layers = tracker_layers.min(num_layers);
        let mut counts = vec![0; num_layers as usize];
        let mut throughput = vec![0; num_layers as usize];
        for layer in 0..tracker_layers as usize {
            counts[layer] = 1;
            throughput[layer] = scale_throughput(tracker_throughput.max(0.0));
        }
        GreedyBaseline {
            num_layers,
            tracker_layers,
            balance_quality: 0.75,
            servers: BTreeMap::new(),
            counts,
            throughput,
        }
    }

    /// Number of holders of every layer.
    pub fn holders_per_layer(&self) -> &[u32] {
        &self.counts
    }

    /// Whether every layer has a holder.
    pub fn is_complete(&self) -> bool {
        !self.counts.contains(&0)
    }

    /// Adds a server; it loads the weakest window its memory allows.
    pub fn join(&mut self, model: &ModelShape, peer: &PeerCapacity) -> Vec<Directive> {
        let volunteer = self.volunteer_range();
        let length = Quantization::ALL
            .iter()
            .filter_map(|&q| peer.max_layers(model, q))
            .max()
            .unwrap_or(0)
            .min(volunteer.len());
        let quantization = Quantization::ALL
            .iter()
            .rev()
            .copied()
            .find(|&q| peer.max_layers(model, q).is_some_and(|l| l >= length))
            .unwrap_or(Quantization::Nf4);
        let mut server = BaselineServer {
            throughput: scale_throughput(peer.throughput.max(0.0)),
            length,
            quantization,
            span: None,
        };
        let mut directives = Vec::new();
        if length > 0 {
            let start = lexicographic_window(&self.throughput, volunteer, length);
            let span = LayerSpan::new(start, start + length);
            self.add(span, server.throughput);
            server.span = Some(span);
            directives.push(Directive::LoadShard {
                peer: peer.peer.clone(),
                layers: span,
                quantization,
            });
        }
        self.servers.insert(peer.peer.clone(), server);
        directives
    }

    /// Removes a server that left or crashed; nobody reacts until [`Self::rebalance`].
    pub fn remove(&mut self, peer: &PeerId) {
        if let Some(server) = self.servers.remove(peer)
            && let Some(span) = server.span
        {
            self.remove_span(span, server.throughput);
        }
    }

    /// Lets every server in turn move its whole span if that improves the
    /// weakest layer enough; repeats until a full pass moves nobody.
    pub fn rebalance(&mut self) -> Vec<Directive> {
        let volunteer = self.volunteer_range();
        let mut directives = Vec::new();
        if volunteer.is_empty() {
            return directives;
        }
        let ids: Vec<PeerId> = self.servers.keys().cloned().collect();
        for _pass in 0..8 {
            let mut moved = false;
            for id in &ids {
                let Some(server) = self.servers.get(id).cloned() else {
                    continue;
                };
                let Some(span) = server.span else { continue };
                let before = self.weakest(volunteer);
                // A move lifts the weakest layer by at most the server's own
                // throughput; skip servers that could not clear the threshold.
                let ceiling = before.saturating_add(server.throughput.max(1));
                if (before as f64) >= self.balance_quality * ceiling as f64 {
                    continue;
                }
                self.remove_span(span, server.throughput);
                let start = lexicographic_window(&self.throughput, volunteer, server.length);
                let candidate = LayerSpan::new(start, start + server.length);
                self.add(candidate, server.throughput);
                let after = self.weakest(volunteer);
                let improves =
                    candidate != span && (before as f64) < self.balance_quality * after as f64;
                if improves {
                    moved = true;
                    directives.push(Directive::DropShard {
                        peer: id.clone(),
                        layers: span,
                        quantization: server.quantization,
                    });
                    directives.push(Directive::LoadShard {
                        peer: id.clone(),
                        layers: candidate,
                        quantization: server.quantization,
                    });
                    if let Some(entry) = self.servers.get_mut(id) {
                        entry.span = Some(candidate);
                    }
                } else {
                    self.remove_span(candidate, server.throughput);
                    self.add(span, server.throughput);
                }
            }
            if !moved {
                break;
            }
        }
        directives
    }

    fn volunteer_range(&self) -> LayerSpan {
        LayerSpan::new(self.tracker_layers, self.num_layers)
    }

    fn weakest(&self, range: LayerSpan) -> u64 {
        self.throughput[range.start as usize..range.end as usize]
            .iter()
            .zip(&self.counts[range.start as usize..range.end as usize])
            .map(|(&t, &c)| if c == 0 { 0 } else { t.max(1) })
            .min()
            .unwrap_or(0)
    }

    fn add(&mut self, span: LayerSpan, throughput: u64) {
        for layer in span.start as usize..span.end as usize {
            self.counts[layer] += 1;
            self.throughput[layer] += throughput;
        }
    }

    fn remove_span(&mut self, span: LayerSpan, throughput: u64) {
        for layer in span.start as usize..span.end as usize {
            self.counts[layer] -= 1;
            self.throughput[layer] -= throughput;
        }
    }
}

/// Start of the window of `length` layers inside `range` whose throughputs,
/// sorted ascending, are lexicographically smallest (leftmost on ties): the
/// window Petals' `_choose_best_start` picks.
fn lexicographic_window(throughput: &[u64], range: LayerSpan, length: u32) -> u32 {
    let length = length.min(range.len());
    if length == 0 {
        return range.start;
    }
    let mut best: Option<(Vec<u64>, u32)> = None;
    let mut window: Vec<u64> = Vec::with_capacity(length as usize);
    for start in range.start..=range.end - length {
        window.clear();
        window.extend_from_slice(&throughput[start as usize..(start + length) as usize]);
        window.sort_unstable();
        if best.as_ref().is_none_or(|(sorted, _)| window < *sorted) {
            best = Some((window.clone(), start));
        }
    }
    best.map_or(range.start, |(_, start)| start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_chosen_by_their_sorted_throughputs() {
        // The least summed window is [3,5) (3 + 3), but [0,2) holds the
        // weakest layer (1): Petals targets it.
        assert_eq!(
            lexicographic_window(&[1, 9, 9, 3, 3], LayerSpan::new(0, 5), 2),
            0
        );
        let throughput = [0, 10, 0, 4];
        // Equal minima: the second-smallest value decides ([1,3) sorts to [0, 10],
        // [2,4) to [0, 4]).
        assert_eq!(
            lexicographic_window(&throughput, LayerSpan::new(1, 4), 2),
            2
        );
        // Ties go to the leftmost window; lengths are capped by the range.
        assert_eq!(lexicographic_window(&[5, 5, 5], LayerSpan::new(0, 3), 1), 0);
        assert_eq!(lexicographic_window(&[5, 5, 5], LayerSpan::new(1, 3), 9), 1);
    }

    fn server(id: &str, layers: u32, model: &ModelShape) -> PeerCapacity {
        let cost = model.layer_cost(Quantization::Nf4, 0).unwrap();
        PeerCapacity {
            peer: PeerId::from(id),
            memory_bytes: cost * u64::from(layers),
            quantizations: vec![Quantization::Nf4],
            throughput: 10.0,
            kv_tokens: 0,
            is_tracker: false,
        }
    }

    #[test]
    fn joining_servers_fill_the_weakest_windows() {
        let model = ModelShape::smollm2_135m();
        let mut mesh = GreedyBaseline::new(&model, 10, 10.0);
        mesh.join(&model, &server("a", 10, &model));
        assert!(!mesh.is_complete());
        mesh.join(&model, &server("b", 10, &model));
        assert!(mesh.is_complete());
        mesh.remove(&PeerId::from("a"));
        assert!(!mesh.is_complete());
        mesh.join(&model, &server("c", 10, &model));
        assert!(mesh.is_complete());
    }

    #[test]
    fn a_gap_is_repaired_by_moving_a_redundant_server() {
        let model = ModelShape::smollm2_135m();
        let mut mesh = GreedyBaseline::new(&model, 10, 10.0);
        for id in ["a", "b", "c", "d"] {
            mesh.join(&model, &server(id, 10, &model));
        }
        assert_eq!(mesh.holders_per_layer()[10..].iter().min(), Some(&2));
        mesh.remove(&PeerId::from("a"));
        mesh.remove(&PeerId::from("c"));
        let gap_before = !mesh.is_complete();
        let directives = mesh.rebalance();
        assert!(gap_before);
        assert!(mesh.is_complete());
        assert!(!directives.is_empty());
    }
}
