//! The coverage-first, memory-aware planner.
//!
//! See the crate documentation for the phases; every phase works on two
//! per-layer arrays (holder count and summed throughput), so a plan costs
//! roughly `O(peers × layers)` in the worst case and far less on a steady mesh.

use std::collections::{BTreeSet, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::model::ModelShape;
use crate::types::{CoverageMap, Directive, PeerCapacity, SpanHolding, spans_where};
use meshnet_types::Quantization;
use meshnet_types::{LayerSpan, PeerId, SpanState};

/// Tunable knobs of the planner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// Fixed size `k` of the tracker's span `[0..k)`; `None` means as many
    /// layers as the tracker's memory allows.
    pub tracker_layers: Option<u32>,
    /// Minimum gain, as a fraction of the weakest layer's throughput, that a
    /// rebalancing move must bring before the planner moves a healthy peer.
    ///
    /// Must be finite and at least [`PlannerConfig::MIN_HYSTERESIS`]. A positive
    /// hysteresis is what makes rebalancing terminate without a move limit:
    /// every move multiplies the weakest layer's throughput by more than
    /// `1 + hysteresis`, so a plan is a fixed point and replanning it is quiet.
    pub hysteresis: f64,
}

impl PlannerConfig {
    /// Smallest accepted hysteresis (0.1 %). Rebalancing makes at most
    /// `1 + ln(total throughput) / ln(1 + hysteresis)` moves per plan, which
    /// this keeps in the tens of thousands even for absurd throughputs.
    pub const MIN_HYSTERESIS: f64 = 0.001;

    /// Checks that every knob is in range.
    pub fn validate(&self) -> Result<(), PlanError> {
        // NaN fails `is_finite`, so the comparison below is total.
        if !self.hysteresis.is_finite() || self.hysteresis < Self::MIN_HYSTERESIS {
            return Err(PlanError::InvalidConfig(format!(
                "hysteresis must be a finite fraction of at least {}, got {}",
                Self::MIN_HYSTERESIS,
                self.hysteresis
            )));
        }
        Ok(())
    }
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            tracker_layers: None,
            hysteresis: 0.2,
        }
    }
}

/// How well the planned mesh covers the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CoverageReport {
    /// Maximal runs of layers nobody holds after the plan.
    pub uncovered: Vec<LayerSpan>,
    /// Extra memory, in bytes, one more volunteer would need so that the mesh
    /// can cover the whole model: the layers the volunteers' combined reach
    /// falls short of `[k, L)`, at the cheapest per-layer cost (cheapest
    /// quantization, smallest KV reservation seen among volunteers). Zero when
    /// everything is covered. It does not depend on where the current spans
    /// sit, so it can be smaller than the uncovered layers' cost when the kept
    /// spans overlap.
    pub missing_memory_bytes: u64,
    /// Number of holders of every layer.
    pub holders_per_layer: Vec<u32>,
    /// Summed throughput (tokens/s) of the holders of every layer.
    pub throughput_per_layer: Vec<f64>,
}

impl CoverageReport {
    /// Whether every layer has at least one holder.
    pub fn is_complete(&self) -> bool {
        self.uncovered.is_empty()
    }

    /// The smallest number of holders of any layer in `layers`.
    pub fn min_redundancy(&self, layers: LayerSpan) -> u32 {
        self.holders_per_layer
            .get(layers.start as usize..layers.end as usize)
            .and_then(|counts| counts.iter().copied().min())
            .unwrap_or(0)
    }
}

/// The outcome of one planning round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Number of layers `k` of the tracker's span `[0..k)`.
    pub tracker_layers: u32,
    /// Directives to publish, grouped by peer id; each peer's drops come first.
    pub directives: Vec<Directive>,
    /// The coverage map once the directives are applied (new layers `Loading`).
    /// Its epoch is the input epoch plus one if there are directives.
    /// Replanning this map with the same peers gives no directives.
    pub map: CoverageMap,
    /// Coverage and redundancy of the planned mesh.
    pub report: CoverageReport,
}

/// Plans shard placement for one model.
#[derive(Debug, Clone)]
pub struct Planner {
    model: ModelShape,
    config: PlannerConfig,
}

/// Scale from tokens/s to the integer units used internally, so that the
/// arithmetic is exact and replanning the same mesh reaches the same result.
pub(crate) const THROUGHPUT_SCALE: f64 = 1000.0;

const QUANTIZATION_COUNT: usize = Quantization::ALL.len();

fn quantization_index(quantization: Quantization) -> usize {
    quantization as usize
}

/// A held span in the current map, split into segments of uniform state.
#[derive(Debug, Clone)]
struct Holding {
    span: LayerSpan,
    quantization: Quantization,
    segments: Vec<(LayerSpan, SpanState)>,
}

/// Working state for one live peer.
#[derive(Debug, Clone)]
struct Candidate {
    /// Index into the caller's capacity slice.
    input_index: usize,
    throughput: u64,
    is_tracker: bool,
    /// Longest span per quantization (0 when unusable), capped to the range it may hold.
    reach_by_quantization: [u32; QUANTIZATION_COUNT],
    /// Longest span at any quantization.
    reach: u32,
    /// What the peer holds now (the run kept from the map).
    old: Option<Holding>,
    /// Every other piece the map says the peer holds (other formats, layers
    /// past the model's end, runs apart from the kept one): all to be dropped.
    stray: Vec<(LayerSpan, Quantization)>,
    /// What the peer holds in the plan being built.
    planned: Option<(LayerSpan, Quantization)>,
}

impl Candidate {
    /// A candidate for `capacity`, found at `input_index` in the caller's
    /// slice, whose spans are capped to `cap` layers. It holds nothing yet.
    fn new(
        input_index: usize,
        capacity: &PeerCapacity,
        model: &ModelShape,
        cap: u32,
        is_tracker: bool,
    ) -> Self {
        let mut reach_by_quantization = [0u32; QUANTIZATION_COUNT];
        for q in Quantization::ALL {
            reach_by_quantization[quantization_index(q)] =
                capacity.max_layers(model, q).unwrap_or(0).min(cap);
        }
        let reach = reach_by_quantization.iter().copied().max().unwrap_or(0);
        Candidate {
            input_index,
            throughput: scale_throughput(capacity.throughput),
            is_tracker,
            reach_by_quantization,
            reach,
            old: None,
            stray: Vec::new(),
            planned: None,
        }
    }

    fn best_quantization_for(&self, layers: u32) -> Option<Quantization> {
        Quantization::ALL
            .iter()
            .rev()
            .copied()
            .find(|&q| layers > 0 && self.reach_by_quantization[quantization_index(q)] >= layers)
    }

    fn reach_at(&self, quantization: Quantization) -> u32 {
        self.reach_by_quantization[quantization_index(quantization)]
    }
}

/// The kinds of gap repair, in tie-break order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum RepairKind {
    /// Extend a planned span over (part of) the gap.
    Grow,
    /// Place a free peer at the gap.
    Place,
    /// Move a peer whose every layer has another holder to the gap.
    Move,
}

/// One candidate gap repair: `position` would hold `span` in `quantization`.
#[derive(Debug, Clone, Copy)]
struct Repair {
    kind: RepairKind,
    position: usize,
    span: LayerSpan,
    quantization: Quantization,
    /// Gap layers the repair covers (at least one).
    covered: u32,
    /// Weight bytes the repair makes its peer load.
    loaded_bytes: u64,
}

impl Repair {
    /// Whether `self` is cheaper than `other`: fewer bytes per covered gap
    /// layer, then grow before place before move, then more of the gap covered.
    fn beats(&self, other: &Repair) -> bool {
        let mine = u128::from(self.loaded_bytes) * u128::from(other.covered);
        let theirs = u128::from(other.loaded_bytes) * u128::from(self.covered);
        mine.cmp(&theirs)
            .then(self.kind.cmp(&other.kind))
            .then(other.covered.cmp(&self.covered))
            .is_lt()
    }
}

/// Per-layer holder counts and summed throughput.
#[derive(Debug, Clone)]
struct LayerLoad {
    count: Vec<u32>,
    throughput: Vec<u64>,
}

impl LayerLoad {
    fn new(num_layers: u32) -> Self {
        LayerLoad {
            count: vec![0; num_layers as usize],
            throughput: vec![0; num_layers as usize],
        }
    }

    fn add(&mut self, span: LayerSpan, throughput: u64) {
        for layer in span.start as usize..span.end as usize {
            self.count[layer] += 1;
            self.throughput[layer] += throughput;
        }
    }

    fn remove(&mut self, span: LayerSpan, throughput: u64) {
        for layer in span.start as usize..span.end as usize {
            self.count[layer] -= 1;
            self.throughput[layer] -= throughput;
        }
    }
}

impl Planner {
    /// A planner for `model` with `config`.
    pub fn new(model: ModelShape, config: PlannerConfig) -> Self {
        Planner { model, config }
    }

    /// The model this planner places.
    pub fn model(&self) -> &ModelShape {
        &self.model
    }

    /// The planner's configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// Plans placement from the current `map` and the live `peers`.
    ///
    /// Holders in `map` that are missing from `peers` are treated as departed.
    /// The result depends only on the inputs, not on the order of `peers`.
    pub fn plan(&self, map: &CoverageMap, peers: &[PeerCapacity]) -> Result<Plan, PlanError> {
        self.model.validate()?;
        self.config.validate()?;
        let mut round = Round::new(self, map, peers)?;
        round.retain_current_spans();
        round.fill_gaps();
        if round.has_gap() && round.cover_is_possible() {
            round.retile_from_scratch();
        }
        round.place_free_peers();
        round.rebalance();
        round.finish(map)
    }
}

/// One planning round over sorted candidates.
struct Round<'a> {
    model: &'a ModelShape,
    config: &'a PlannerConfig,
    peers: &'a [PeerCapacity],
    num_layers: u32,
    tracker_layers: u32,
    /// Candidates sorted by peer id.
    candidates: Vec<Candidate>,
    tracker: usize,
    load: LayerLoad,
    /// Free candidates keyed by (reach, position), for best-fit lookups.
    free: BTreeSet<(u32, usize)>,
}

impl<'a> Round<'a> {
    fn new(
        planner: &'a Planner,
        map: &CoverageMap,
        peers: &'a [PeerCapacity],
    ) -> Result<Self, PlanError> {
        let model = &planner.model;
        let num_layers = model.num_layers;
        let order = order_by_peer_id(peers)?;
        let tracker = locate_tracker(peers, &order)?;
        let tracker_layers = tracker_span_length(&planner.config, model, &peers[order[tracker]])?;
        let volunteer_layers = num_layers - tracker_layers;
        let mut candidates: Vec<Candidate> = order
            .iter()
            .enumerate()
            .map(|(position, &input_index)| {
                let is_tracker = position == tracker;
                let cap = if is_tracker {
                    num_layers
                } else {
                    volunteer_layers
                };
                Candidate::new(input_index, &peers[input_index], model, cap, is_tracker)
            })
            .collect();

        attach_current_holdings(&mut candidates, peers, map, num_layers);

        Ok(Round {
            model,
            config: &planner.config,
            peers,
            num_layers,
            tracker_layers,
            candidates,
            tracker,
            load: LayerLoad::new(num_layers),
            free: BTreeSet::new(),
        })
    }

    fn volunteer_range(&self) -> LayerSpan {
        LayerSpan::new(self.tracker_layers, self.num_layers)
    }

    fn assign(&mut self, position: usize, span: LayerSpan, quantization: Quantization) {
        let candidate = &mut self.candidates[position];
        if let Some((old_span, _)) = candidate.planned.take() {
            self.load.remove(old_span, candidate.throughput);
        }
        candidate.planned = Some((span, quantization));
        self.load.add(span, candidate.throughput);
    }

    fn unassign(&mut self, position: usize) {
        let candidate = &mut self.candidates[position];
        if let Some((span, _)) = candidate.planned.take() {
            self.load.remove(span, candidate.throughput);
        }
    }

    /// Phase 1: the tracker's span, then every current span that still fits
    /// (shrunk in place when the peer's memory no longer allows all of it).
    fn retain_current_spans(&mut self) {
        let tracker = self.tracker;
        // `tracker_layers` never exceeds the tracker's reach, so a format fits.
        if let Some(quantization) =
            self.candidates[tracker].best_quantization_for(self.tracker_layers)
        {
            self.assign(
                tracker,
                LayerSpan::new(0, self.tracker_layers),
                quantization,
            );
        }
        let volunteer = self.volunteer_range();
        let mut shrinking = Vec::new();
        for position in 0..self.candidates.len() {
            if position == tracker {
                continue;
            }
            let candidate = &self.candidates[position];
            let Some(old) = &candidate.old else {
                self.free_up(position);
                continue;
            };
            let reach = candidate.reach_at(old.quantization);
            let span = old.span.intersection(volunteer);
            if reach == 0 || span.is_empty() {
                self.free_up(position);
            } else if span.len() > reach {
                shrinking.push((position, span, old.quantization, reach));
            } else {
                self.assign(position, span, old.quantization);
            }
        }
        // Shrunk peers keep the part of their span where the mesh is weakest.
        for (position, span, quantization, reach) in shrinking {
            let start = min_sum_window(&self.load.throughput, span, reach);
            self.assign(position, LayerSpan::new(start, start + reach), quantization);
        }
    }

    fn free_up(&mut self, position: usize) {
        let candidate = &self.candidates[position];
        if candidate.reach > 0 && !candidate.is_tracker {
            self.free.insert((candidate.reach, position));
        }
    }

    fn first_gap_from(&self, from: u32) -> Option<LayerSpan> {
        let start = (from..self.num_layers).find(|&l| self.load.count[l as usize] == 0)?;
        let end = (start..self.num_layers)
            .find(|&l| self.load.count[l as usize] > 0)
            .unwrap_or(self.num_layers);
        Some(LayerSpan::new(start, end))
    }

    fn has_gap(&self) -> bool {
        self.load.count.contains(&0)
    }

    /// Phase 2: close every gap, left to right, with the repair that loads the
    /// fewest bytes per gap layer it covers (see [`Round::cheapest_repair`]).
    fn fill_gaps(&mut self) {
        loop {
            let mut progressed = false;
            let mut cursor = self.tracker_layers;
            // Every repair covers at least one gap layer and uncovers none.
            while let Some(gap) = self.first_gap_from(cursor) {
                match self.cheapest_repair(gap) {
                    Some(repair) => {
                        self.apply(repair);
                        progressed = true;
                    }
                    None => cursor = gap.end,
                }
            }
            if !progressed || !self.has_gap() {
                break;
            }
        }
    }

    /// The cheapest way to cover (part of) `gap`: grow a span that can reach
    /// it, place the best-fitting free peer at its start, or move there a peer
    /// all of whose layers have another holder. Repairs are ranked by bytes
    /// loaded per gap layer covered; ties prefer growing, then placing, then
    /// moving, then covering more of the gap.
    fn cheapest_repair(&self, gap: LayerSpan) -> Option<Repair> {
        let mut best: Option<Repair> = None;
        let mut consider = |repair: Repair| {
            if best.as_ref().is_none_or(|current| repair.beats(current)) {
                best = Some(repair);
            }
        };
        for (position, candidate) in self.candidates.iter().enumerate() {
            if candidate.is_tracker {
                continue;
            }
            let Some((span, quantization)) = candidate.planned else {
                continue;
            };
            let reach = candidate.reach_at(quantization);
            let grown = if span.end <= gap.start && span.start + reach > gap.start {
                LayerSpan::new(span.start, (span.start + reach).min(gap.end))
            } else if span.start >= gap.end && span.end.saturating_sub(reach) < gap.end {
                LayerSpan::new(span.end.saturating_sub(reach).max(gap.start), span.end)
            } else {
                continue;
            };
            consider(Repair {
                kind: RepairKind::Grow,
                position,
                span: grown,
                quantization,
                covered: gap.intersection(grown).len(),
                loaded_bytes: self
                    .model
                    .span_bytes(quantization, grown.len() - span.len()),
            });
        }
        if let Some(position) = self.best_free_for(gap)
            && let Some(repair) = self.full_reach_repair(RepairKind::Place, position, gap)
        {
            consider(repair);
        }
        if let Some(position) = self.best_redundant_for(gap)
            && let Some(repair) = self.full_reach_repair(RepairKind::Move, position, gap)
        {
            consider(repair);
        }
        best
    }

    fn apply(&mut self, repair: Repair) {
        if repair.kind == RepairKind::Place {
            let reach = self.candidates[repair.position].reach;
            self.free.remove(&(reach, repair.position));
        }
        self.assign(repair.position, repair.span, repair.quantization);
    }

    /// A repair that puts `position` at its full reach from the start of `gap`.
    fn full_reach_repair(
        &self,
        kind: RepairKind,
        position: usize,
        gap: LayerSpan,
    ) -> Option<Repair> {
        let (span, quantization) = self.full_reach_span(position, gap.start)?;
        let covered = gap.intersection(span).len();
        (covered > 0).then(|| Repair {
            kind,
            position,
            span,
            quantization,
            covered,
            loaded_bytes: self.model.span_bytes(quantization, span.len()),
        })
    }

    /// The free peer that best fits `gap`: the smallest reach that closes it,
    /// else the longest reach.
    fn best_free_for(&self, gap: LayerSpan) -> Option<usize> {
        self.free
            .range((gap.len(), 0)..)
            .next()
            .or_else(|| self.free.iter().next_back())
            .map(|&(_, position)| position)
    }

    /// The span of `position`'s full reach starting at `from` (shifted left to
    /// end at the last layer if it would overrun), in the best format for it.
    fn full_reach_span(&self, position: usize, from: u32) -> Option<(LayerSpan, Quantization)> {
        let candidate = &self.candidates[position];
        let reach = candidate.reach;
        let span = if from + reach <= self.num_layers {
            LayerSpan::new(from, from + reach)
        } else {
            LayerSpan::new(
                self.num_layers
                    .saturating_sub(reach)
                    .max(self.tracker_layers),
                self.num_layers,
            )
        };
        Some((span, candidate.best_quantization_for(span.len())?))
    }

    fn place_at_full_reach(&mut self, position: usize, from: u32) {
        if let Some((span, quantization)) = self.full_reach_span(position, from) {
            self.assign(position, span, quantization);
        }
    }

    /// The peer whose every layer has another holder that is best moved into
    /// `gap`: one whose reach closes it if any, leaving the strongest layers behind.
    fn best_redundant_for(&self, gap: LayerSpan) -> Option<usize> {
        let need = gap.len();
        // (closes the gap, weakest remaining throughput on its old span, position)
        let mut best: Option<(bool, u64, usize)> = None;
        for (position, candidate) in self.candidates.iter().enumerate() {
            if candidate.is_tracker || candidate.reach == 0 {
                continue;
            }
            let Some((span, _)) = candidate.planned else {
                continue;
            };
            let layers = span.start as usize..span.end as usize;
            if self.load.count[layers.clone()].iter().any(|&c| c < 2) {
                continue;
            }
            let remaining = self.load.throughput[layers]
                .iter()
                .map(|&t| t - candidate.throughput)
                .min()
                .unwrap_or(0);
            let key = (candidate.reach >= need, remaining, position);
            let better = match best {
                None => true,
                Some((closes, weakest, _)) => (key.0, key.1) > (closes, weakest),
            };
            if better {
                best = Some(key);
            }
        }
        best.map(|(_, _, position)| position)
    }

    /// Whether the live peers could cover every layer if placed from scratch:
    /// each volunteer span can be laid end to end after the tracker's.
    fn cover_is_possible(&self) -> bool {
        self.volunteer_reach() >= u64::from(self.num_layers - self.tracker_layers)
    }

    /// The layers all volunteers could hold together, each at its longest span.
    fn volunteer_reach(&self) -> u64 {
        self.candidates
            .iter()
            .filter(|c| !c.is_tracker)
            .map(|c| u64::from(c.reach))
            .sum()
    }

    /// Fallback when repairs in place cannot close the gaps but a cover exists:
    /// lay volunteer spans end to end, longest reach first.
    fn retile_from_scratch(&mut self) {
        let volunteers: Vec<usize> = (0..self.candidates.len())
            .filter(|&p| p != self.tracker)
            .collect();
        for &position in &volunteers {
            self.unassign(position);
        }
        let mut order: Vec<usize> = volunteers
            .into_iter()
            .filter(|&p| self.candidates[p].reach > 0)
            .collect();
        order.sort_by_key(|&p| (std::cmp::Reverse(self.candidates[p].reach), p));
        self.free.clear();
        let mut next = self.tracker_layers;
        for position in order {
            if next < self.num_layers {
                self.place_at_full_reach(position, next);
                next = self.candidates[position]
                    .planned
                    .map_or(next, |(span, _)| span.end);
            } else {
                self.free
                    .insert((self.candidates[position].reach, position));
            }
        }
    }

    /// Phase 3: peers still free take the window with the least throughput behind it.
    fn place_free_peers(&mut self) {
        let volunteer = self.volunteer_range();
        if volunteer.is_empty() {
            return;
        }
        let mut order: Vec<usize> = self.free.iter().map(|&(_, p)| p).collect();
        order.sort_by_key(|&p| {
            let c = &self.candidates[p];
            (
                std::cmp::Reverse(c.reach),
                std::cmp::Reverse(c.throughput),
                p,
            )
        });
        self.free.clear();
        for position in order {
            let reach = self.candidates[position].reach;
            let start = least_held_window(&self.load, volunteer, reach);
            let span = LayerSpan::new(start, start + reach);
            if let Some(quantization) = self.candidates[position].best_quantization_for(reach) {
                self.assign(position, span, quantization);
            }
        }
    }

    /// Phase 4: move or grow a span only while that raises the weakest
    /// volunteer layer's throughput by more than the hysteresis.
    fn rebalance(&mut self) {
        let volunteer = self.volunteer_range();
        if volunteer.is_empty() || self.has_gap() {
            return;
        }
        // Strongest peers first: a move can lift the weakest layer by at most
        // the mover's own throughput, which lets the search stop early.
        let mut order: Vec<usize> = (0..self.candidates.len())
            .filter(|&p| !self.candidates[p].is_tracker && self.candidates[p].reach > 0)
            .collect();
        order.sort_by_key(|&p| (std::cmp::Reverse(self.candidates[p].throughput), p));
        let mut scratch = WindowScratch::default();
        // No move limit is needed: every accepted change makes the weakest
        // volunteer layer's (integer) throughput exceed `weakest × (1 + h)`
        // with `h >= MIN_HYSTERESIS > 0`, so it strictly grows (from 0 to at
        // least 1, then by a factor above 1 + h) and is bounded by the summed
        // throughput of all peers. The loop therefore ends, and it ends only
        // when no change clears the threshold: the plan is a fixed point.
        loop {
            let found = self
                .best_rebalance_change(volunteer, &order, true, &mut scratch)
                .or_else(|| self.best_rebalance_change(volunteer, &order, false, &mut scratch));
            match found {
                Some((position, span, quantization)) => self.assign(position, span, quantization),
                None => break,
            }
        }
    }

    /// The best single grow (`grow == true`) or move that lifts the weakest
    /// volunteer layer above the hysteresis threshold.
    fn best_rebalance_change(
        &self,
        volunteer: LayerSpan,
        order: &[usize],
        grow: bool,
        scratch: &mut WindowScratch,
    ) -> Option<(usize, LayerSpan, Quantization)> {
        let base = volunteer.start as usize;
        let layers = &self.load.throughput[base..volunteer.end as usize];
        let weakest = layers.iter().copied().min()?;
        let required = weakest as f64 * (1.0 + self.config.hysteresis);
        let weak_first = layers.iter().position(|&t| t as f64 <= required)?;
        let weak_last = layers.iter().rposition(|&t| t as f64 <= required)?;
        let weak_extent = (weak_last - weak_first + 1) as u32;

        // (new weakest, loaded layers, position, span, quantization)
        let mut best: Option<(u64, u32, usize, LayerSpan, Quantization)> = None;
        let mut without = vec![0u64; layers.len()];
        for &position in order {
            let candidate = &self.candidates[position];
            let ceiling = weakest + candidate.throughput;
            if ceiling as f64 <= required || best.is_some_and(|(gain, ..)| ceiling < gain) {
                break;
            }
            let Some((span, quantization)) = candidate.planned else {
                continue;
            };
            let (length, new_quantization) = if grow {
                let length = candidate.reach_at(quantization);
                if length <= span.len() {
                    continue;
                }
                (length, quantization)
            } else {
                let Some(q) = candidate.best_quantization_for(candidate.reach) else {
                    continue;
                };
                (candidate.reach, q)
            };
            if length < weak_extent {
                continue;
            }
            without.copy_from_slice(layers);
            for layer in span.start..span.end {
                without[(layer - volunteer.start) as usize] -= candidate.throughput;
            }
            let relative = LayerSpan::new(span.start - volunteer.start, span.end - volunteer.start);
            let starts = if grow {
                relative.end.saturating_sub(length)..=relative.start.min(volunteer.len() - length)
            } else {
                0..=volunteer.len() - length
            };
            let Some((gain, start, loaded)) = best_window_after_move(
                &without,
                candidate.throughput,
                length,
                starts,
                relative,
                new_quantization == quantization,
                scratch,
            ) else {
                continue;
            };
            if gain as f64 > required {
                let span =
                    LayerSpan::new(start + volunteer.start, start + volunteer.start + length);
                consider(&mut best, (gain, loaded, position, span, new_quantization));
            }
        }
        best.map(|(_, _, position, span, quantization)| (position, span, quantization))
    }

    fn finish(self, map: &CoverageMap) -> Result<Plan, PlanError> {
        let mut directives = Vec::new();
        let mut holdings = Vec::new();
        for candidate in &self.candidates {
            let peer = &self.peers[candidate.input_index].peer;
            diff_directives(peer, candidate, &mut directives);
            if let Some((span, quantization)) = candidate.planned {
                planned_holdings(
                    peer,
                    candidate.old.as_ref(),
                    span,
                    quantization,
                    &mut holdings,
                );
            }
        }
        let epoch = if directives.is_empty() {
            map.epoch
        } else {
            map.epoch
                .checked_add(1)
                .ok_or(PlanError::EpochOverflow(map.epoch))?
        };
        let uncovered = spans_where(&self.load.count, |count| count == 0);
        let uncovered_layers: u64 = uncovered.iter().map(|s| u64::from(s.len())).sum();
        let missing_memory_bytes = if uncovered_layers == 0 {
            0
        } else {
            // Coverage is exact, so a gap means the volunteers' reaches add up
            // to less than `[k, L)`; the shortfall is what one more peer needs.
            let shortfall = u64::from(self.num_layers - self.tracker_layers)
                .saturating_sub(self.volunteer_reach());
            let missing_layers = if shortfall == 0 {
                uncovered_layers
            } else {
                shortfall
            };
            let smallest_kv = self
                .candidates
                .iter()
                .filter(|c| !c.is_tracker)
                .map(|c| self.peers[c.input_index].kv_tokens)
                .min()
                .unwrap_or(0);
            let cheapest = Quantization::ALL
                .iter()
                .filter_map(|&q| self.model.layer_cost(q, smallest_kv))
                .min()
                .unwrap_or(0);
            cheapest.saturating_mul(missing_layers)
        };
        Ok(Plan {
            tracker_layers: self.tracker_layers,
            directives,
            map: CoverageMap { epoch, holdings },
            report: CoverageReport {
                uncovered,
                missing_memory_bytes,
                holders_per_layer: self.load.count,
                throughput_per_layer: self
                    .load
                    .throughput
                    .iter()
                    .map(|&t| t as f64 / THROUGHPUT_SCALE)
                    .collect(),
            },
        })
    }
}

fn consider(
    best: &mut Option<(u64, u32, usize, LayerSpan, Quantization)>,
    option: (u64, u32, usize, LayerSpan, Quantization),
) {
    let better = match best {
        None => true,
        Some((gain, loaded, _, _, _)) => {
            option.0 > *gain || (option.0 == *gain && option.1 < *loaded)
        }
    };
    if better {
        *best = Some(option);
    }
}

/// Largest throughput taken into account, in internal units (about 4.3
/// million tokens/s): sums over up to 2^32 peers then still fit in a `u64`.
const MAX_SCALED_THROUGHPUT: u64 = 1 << 32;

pub(crate) fn scale_throughput(tokens_per_second: f64) -> u64 {
    // Float-to-int `as` saturates; inputs were checked to be finite and >= 0.
    ((tokens_per_second * THROUGHPUT_SCALE).round() as u64).min(MAX_SCALED_THROUGHPUT)
}

/// Start of the window of `length` layers inside `range` with the least
/// summed throughput (leftmost on ties).
/// The start of the window of `length` layers within `range` with the fewest holders summed
/// over its layers, and of those the least throughput: a free peer adds redundancy where
/// there is least of it first (what failover needs), and throughput, which measurements on
/// a busy machine scatter widely, only breaks ties.
fn least_held_window(load: &LayerLoad, range: LayerSpan, length: u32) -> u32 {
    let length = length.min(range.len());
    if length == 0 {
        return range.start;
    }
    let window = |start: u32| {
        let layers = start as usize..(start + length) as usize;
        let holders: u64 = load.count[layers.clone()]
            .iter()
            .map(|&c| u64::from(c))
            .sum();
        let throughput: u64 = load.throughput[layers].iter().sum();
        (holders, throughput)
    };
    (range.start..=range.end - length)
        .min_by_key(|&start| (window(start), start))
        .unwrap_or(range.start)
}

pub(crate) fn min_sum_window(throughput: &[u64], range: LayerSpan, length: u32) -> u32 {
    let length = length.min(range.len());
    if length == 0 {
        return range.start;
    }
    let mut window: u64 = throughput[range.start as usize..(range.start + length) as usize]
        .iter()
        .sum();
    let mut best = (window, range.start);
    for start in range.start + 1..=range.end - length {
        window =
            window + throughput[(start + length - 1) as usize] - throughput[(start - 1) as usize];
        if window < best.0 {
            best = (window, start);
        }
    }
    best.1
}

/// Reusable buffers for [`best_window_after_move`].
#[derive(Debug, Default)]
struct WindowScratch {
    prefix_min: Vec<u64>,
    suffix_min: Vec<u64>,
    window_min: Vec<u64>,
    deque: VecDeque<usize>,
}

/// For a peer of throughput `added` whose old span `old` has already been
/// subtracted from `without`, finds the window of `length` layers (start in
/// `starts`) that maximizes the weakest layer afterwards. Returns the new
/// weakest throughput, the window start, and the layers it would load.
fn best_window_after_move(
    without: &[u64],
    added: u64,
    length: u32,
    starts: std::ops::RangeInclusive<u32>,
    old: LayerSpan,
    same_format: bool,
    scratch: &mut WindowScratch,
) -> Option<(u64, u32, u32)> {
    let n = without.len();
    let length = length as usize;
    if length == 0 || length > n {
        return None;
    }
    let WindowScratch {
        prefix_min,
        suffix_min,
        window_min,
        deque,
    } = scratch;
    prefix_min.clear();
    prefix_min.resize(n + 1, u64::MAX);
    for i in 0..n {
        prefix_min[i + 1] = prefix_min[i].min(without[i]);
    }
    suffix_min.clear();
    suffix_min.resize(n + 1, u64::MAX);
    for i in (0..n).rev() {
        suffix_min[i] = suffix_min[i + 1].min(without[i]);
    }
    // Sliding minimum of `without` over windows of `length`.
    window_min.clear();
    window_min.resize(n - length + 1, u64::MAX);
    deque.clear();
    for i in 0..n {
        while deque.back().is_some_and(|&j| without[j] >= without[i]) {
            deque.pop_back();
        }
        deque.push_back(i);
        if deque.front().is_some_and(|&j| j + length <= i) {
            deque.pop_front();
        }
        if i + 1 >= length {
            window_min[i + 1 - length] = without[deque.front().copied().unwrap_or(i)];
        }
    }
    let mut best: Option<(u64, u32, u32)> = None;
    for start in starts {
        let s = start as usize;
        if s + length > n {
            break;
        }
        let weakest = prefix_min[s]
            .min(suffix_min[s + length])
            .min(window_min[s] + added);
        let window = LayerSpan::new(start, start + length as u32);
        let loaded = if same_format {
            window.len() - window.intersection(old).len()
        } else {
            window.len()
        };
        let better = match best {
            None => true,
            Some((w, _, l)) => weakest > w || (weakest == w && loaded < l),
        };
        if better {
            best = Some((weakest, start, loaded));
        }
    }
    best
}

/// Indices into `peers` in peer-id order; a peer listed twice is an error.
fn order_by_peer_id(peers: &[PeerCapacity]) -> Result<Vec<usize>, PlanError> {
    let mut order: Vec<usize> = (0..peers.len()).collect();
    order.sort_unstable_by(|&a, &b| peers[a].peer.cmp(&peers[b].peer));
    for pair in order.windows(2) {
        if peers[pair[0]].peer == peers[pair[1]].peer {
            return Err(PlanError::DuplicatePeer(peers[pair[0]].peer.clone()));
        }
    }
    Ok(order)
}

/// The position in `order` of the one tracker. Walking the peers in that
/// order, it also rejects a throughput that is negative or not finite.
fn locate_tracker(peers: &[PeerCapacity], order: &[usize]) -> Result<usize, PlanError> {
    let mut tracker: Option<usize> = None;
    for (position, &input_index) in order.iter().enumerate() {
        let capacity = &peers[input_index];
        if !capacity.throughput.is_finite() || capacity.throughput < 0.0 {
            return Err(PlanError::InvalidThroughput(capacity.peer.clone()));
        }
        if capacity.is_tracker {
            if let Some(first) = tracker {
                return Err(PlanError::MultipleTrackers {
                    first: peers[order[first]].peer.clone(),
                    second: capacity.peer.clone(),
                });
            }
            tracker = Some(position);
        }
    }
    tracker.ok_or(PlanError::NoTracker)
}

/// The number of layers `k` of the tracker's span `[0..k)`: the configured
/// count, which the model must have and the tracker must be able to hold, or
/// else as many as the tracker's memory allows. Either way the tracker must
/// fit the embeddings and the head.
fn tracker_span_length(
    config: &PlannerConfig,
    model: &ModelShape,
    tracker: &PeerCapacity,
) -> Result<u32, PlanError> {
    let num_layers = model.num_layers;
    let extra = model.tracker_extra_bytes();
    if tracker.memory_bytes < extra {
        return Err(PlanError::TrackerCannotHoldEmbeddings {
            available: tracker.memory_bytes,
            required: extra,
        });
    }
    let tracker_max = Quantization::ALL
        .iter()
        .filter_map(|&q| tracker.max_layers(model, q))
        .max()
        .unwrap_or(0);
    match config.tracker_layers {
        Some(requested) if requested > num_layers => Err(PlanError::InvalidConfig(format!(
            "tracker_layers {requested} exceeds the model's {num_layers} layers"
        ))),
        Some(requested) if requested > tracker_max => Err(PlanError::TrackerSpanDoesNotFit {
            requested,
            max: tracker_max,
        }),
        Some(requested) => Ok(requested),
        None => Ok(tracker_max),
    }
}

/// A map entry of a live peer, with the peer's position among the candidates.
type PeerEntry<'m> = (usize, &'m SpanHolding);

/// A piece of a model's layers in one quantization.
type Piece = (LayerSpan, Quantization);

/// Reads each live peer's current holding from the map. Pieces inside the
/// model in the same quantization are merged when they touch; the longest run
/// is kept. Everything else the peer holds (other runs, other formats, layers
/// past the model's end) becomes a stray to drop.
fn attach_current_holdings(
    candidates: &mut [Candidate],
    peers: &[PeerCapacity],
    map: &CoverageMap,
    num_layers: u32,
) {
    let position_of: HashMap<&str, usize> = candidates
        .iter()
        .enumerate()
        .map(|(position, c)| (peers[c.input_index].peer.as_str(), position))
        .collect();
    let mut entries: Vec<PeerEntry> = map
        .holdings
        .iter()
        .filter(|h| !h.layers.is_empty())
        .filter_map(|h| position_of.get(h.peer.as_str()).map(|&p| (p, h)))
        .collect();
    entries.sort_by_key(|(position, h)| (*position, h.layers.start, h.layers.end, h.quantization));
    for group in entries.chunk_by(|a, b| a.0 == b.0) {
        let (kept, stray) = kept_and_stray(group, num_layers);
        let candidate = &mut candidates[group[0].0];
        candidate.stray = stray;
        candidate.old = kept;
    }
}

/// Splits one peer's map entries (sorted by layers) into the run it keeps
/// and the stray pieces it must drop, sorted by layers.
fn kept_and_stray(group: &[PeerEntry], num_layers: u32) -> (Option<Holding>, Vec<Piece>) {
    // The common case: one piece, inside the model. Nothing is stray.
    if let [(_, holding)] = group
        && holding.layers.end <= num_layers
    {
        let kept = Holding {
            span: holding.layers,
            quantization: holding.quantization,
            segments: vec![(holding.layers, holding.state)],
        };
        return (Some(kept), Vec::new());
    }
    let mut runs = runs_inside_model(group, num_layers);
    let kept = take_longest_run(&mut runs);
    let stray = stray_pieces(group, kept.as_ref());
    (kept, stray)
}

/// The peer's pieces clamped to the model's layers and merged, per
/// quantization, where they touch or overlap. Each run keeps the state of
/// every layer it covers.
fn runs_inside_model(group: &[PeerEntry], num_layers: u32) -> Vec<Holding> {
    let mut runs: Vec<Holding> = Vec::new();
    for &(_, holding) in group {
        let span = LayerSpan::new(holding.layers.start, holding.layers.end.min(num_layers));
        if span.is_empty() {
            continue;
        }
        match runs
            .iter_mut()
            .find(|r| r.quantization == holding.quantization && r.span.end >= span.start)
        {
            Some(run) => {
                let fresh = LayerSpan::new(span.start.max(run.span.end), span.end);
                if !fresh.is_empty() {
                    run.segments.push((fresh, holding.state));
                }
                run.span.end = run.span.end.max(span.end);
            }
            None => runs.push(Holding {
                span,
                quantization: holding.quantization,
                segments: vec![(span, holding.state)],
            }),
        }
    }
    runs
}

/// Removes and returns the run worth keeping: the longest, then the one
/// starting first, then the one in the highest quantization.
fn take_longest_run(runs: &mut Vec<Holding>) -> Option<Holding> {
    runs.iter()
        .enumerate()
        .max_by(|(_, a), (_, b)| {
            a.span
                .len()
                .cmp(&b.span.len())
                .then(b.span.start.cmp(&a.span.start))
                .then(a.quantization.cmp(&b.quantization))
        })
        .map(|(i, _)| i)
        .map(|keep| runs.swap_remove(keep))
}

/// Everything the peer holds outside `kept`, layers past the model's end
/// included, as disjoint pieces per quantization sorted by layers.
fn stray_pieces(group: &[PeerEntry], kept: Option<&Holding>) -> Vec<Piece> {
    let mut held: Vec<(Quantization, LayerSpan)> = group
        .iter()
        .map(|(_, h)| (h.quantization, h.layers))
        .collect();
    held.sort_by_key(|&(q, span)| (q, span.start, span.end));
    let mut merged: Vec<(Quantization, LayerSpan)> = Vec::new();
    for (q, span) in held {
        match merged.last_mut() {
            Some((last_q, last)) if *last_q == q && last.end >= span.start => {
                last.end = last.end.max(span.end);
            }
            _ => merged.push((q, span)),
        }
    }
    let mut stray: Vec<Piece> = Vec::new();
    for (q, span) in merged {
        match kept {
            Some(run) if run.quantization == q => {
                stray.extend(subtract(span, run.span).into_iter().map(|piece| (piece, q)));
            }
            _ => stray.push((span, q)),
        }
    }
    stray.sort_by_key(|&(span, q)| (span.start, span.end, q));
    stray
}

/// `span` minus `removed`: up to two pieces, in layer order.
fn subtract(span: LayerSpan, removed: LayerSpan) -> Vec<LayerSpan> {
    let overlap = span.intersection(removed);
    if overlap.is_empty() {
        return vec![span];
    }
    [
        LayerSpan::new(span.start, overlap.start),
        LayerSpan::new(overlap.end, span.end),
    ]
    .into_iter()
    .filter(|piece| !piece.is_empty())
    .collect()
}

/// Directives turning what `candidate` holds into what it is planned to hold.
fn diff_directives(peer: &PeerId, candidate: &Candidate, directives: &mut Vec<Directive>) {
    let drop = |layers: LayerSpan, quantization: Quantization| Directive::DropShard {
        peer: peer.clone(),
        layers,
        quantization,
    };
    for &(layers, quantization) in &candidate.stray {
        directives.push(drop(layers, quantization));
    }
    let old = candidate
        .old
        .as_ref()
        .map(|holding| (holding.span, holding.quantization));
    match (old, candidate.planned) {
        (None, None) => {}
        (Some((old_span, old_q)), None) => directives.push(drop(old_span, old_q)),
        (old, Some((new_span, quantization))) => {
            let kept = match old {
                Some((old_span, old_q))
                    if old_q == quantization && !old_span.intersection(new_span).is_empty() =>
                {
                    for piece in subtract(old_span, new_span) {
                        directives.push(drop(piece, old_q));
                    }
                    Some(old_span)
                }
                Some((old_span, old_q)) => {
                    directives.push(drop(old_span, old_q));
                    None
                }
                None => None,
            };
            let to_load = match kept {
                Some(old_span) => subtract(new_span, old_span),
                None => vec![new_span],
            };
            for layers in to_load {
                directives.push(Directive::LoadShard {
                    peer: peer.clone(),
                    layers,
                    quantization,
                });
            }
        }
    }
}

/// Map entries for a planned span: kept layers keep their state, new layers
/// are `Loading`; adjacent segments in the same state are merged.
fn planned_holdings(
    peer: &PeerId,
    old: Option<&Holding>,
    span: LayerSpan,
    quantization: Quantization,
    holdings: &mut Vec<SpanHolding>,
) {
    let mut segments: Vec<(LayerSpan, SpanState)> = Vec::new();
    let kept_segments: Vec<(LayerSpan, SpanState)> = match old {
        Some(holding) if holding.quantization == quantization => holding
            .segments
            .iter()
            .map(|&(segment, state)| (segment.intersection(span), state))
            .filter(|(segment, _)| !segment.is_empty())
            .collect(),
        _ => Vec::new(),
    };
    let mut cursor = span.start;
    for (segment, state) in kept_segments {
        if segment.start > cursor {
            segments.push((LayerSpan::new(cursor, segment.start), SpanState::Loading));
        }
        segments.push((segment, state));
        cursor = segment.end;
    }
    if cursor < span.end {
        segments.push((LayerSpan::new(cursor, span.end), SpanState::Loading));
    }
    let mut merged: Vec<(LayerSpan, SpanState)> = Vec::new();
    for (segment, state) in segments {
        match merged.last_mut() {
            Some((last, last_state)) if *last_state == state && last.end == segment.start => {
                last.end = segment.end;
            }
            _ => merged.push((segment, state)),
        }
    }
    holdings.extend(merged.into_iter().map(|(layers, state)| SpanHolding {
        peer: peer.clone(),
        layers,
        quantization,
        state,
    }));
}

#[cfg(test)]
#[path = "planner_tests.rs"]
mod tests;
