//! `meshnet-sim`: replays a churn trace against the planner and, in the same
//! run, against a Petals-like greedy baseline, and reports availability,
//! redundancy, reload cost and planning time for both.

use std::time::Instant;

use clap::{Parser, ValueEnum};
use meshnet_planner::baseline::GreedyBaseline;
use meshnet_planner::scenario::{self, MeshProfile};
use meshnet_planner::{
    CoverageMap, Directive, MAX_LAYERS, ModelShape, PeerCapacity, Planner, PlannerConfig,
};
use meshnet_types::{LayerSpan, PeerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// Model shapes the simulator knows.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelChoice {
    /// Llama 3 70B (80 layers).
    Llama70b,
    /// SmolLM2-135M (30 layers).
    Smollm2_135m,
}

/// Simulate shard planning under churn.
#[derive(Debug, Parser)]
#[command(name = "meshnet-sim", version)]
struct Args {
    /// Number of volunteer peers at the start (the tracker comes on top).
    #[arg(long, default_value_t = 1000)]
    peers: usize,
    /// Number of layers; defaults to the model's own (per-layer sizes are kept).
    #[arg(long)]
    layers: Option<u32>,
    /// Model whose layer sizes are simulated.
    #[arg(long, value_enum, default_value = "llama70b")]
    model: ModelChoice,
    /// Number of churn events to replay.
    #[arg(long, default_value_t = 500)]
    steps: usize,
    /// Seed of the mesh and of the churn trace.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Relative weight of joins in the churn trace.
    #[arg(long, default_value_t = 0.5)]
    join_rate: f64,
    /// Relative weight of clean leaves in the churn trace.
    #[arg(long, default_value_t = 0.25)]
    leave_rate: f64,
    /// Relative weight of crashes in the churn trace.
    #[arg(long, default_value_t = 0.25)]
    crash_rate: f64,
    /// Fraction of volunteers that are CPU-only.
    #[arg(long, default_value_t = 0.2)]
    cpu_fraction: f64,
    /// Tracker device memory in GiB (its span `[0..k)` is as long as this allows).
    #[arg(long, default_value_t = 12)]
    tracker_gib: u64,
    /// Fix the tracker's span to `[0..k)` instead of sizing it by its memory.
    #[arg(long)]
    tracker_layers: Option<u32>,
    /// Planner hysteresis (fraction of the weakest layer's throughput, at least 0.001).
    #[arg(long, default_value_t = 0.2)]
    hysteresis: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Join,
    Leave,
    Crash,
}

#[derive(Debug, Default, Serialize)]
struct Summary {
    mean: f64,
    max: f64,
}

#[derive(Debug, Default, Serialize)]
struct Percentiles {
    p50: f64,
    max: f64,
}

#[derive(Debug, Serialize)]
struct StrategyReport {
    /// Fraction of churn steps during which every layer had a holder.
    availability: f64,
    /// Fewest holders of any volunteer-served layer `[k, L)` after any step.
    min_redundancy: u32,
    directives_per_event: Summary,
    bytes_loaded_per_event: Summary,
    plan_time_ms: Percentiles,
    initial_plan_ms: f64,
}

#[derive(Debug, Serialize)]
struct EventCounts {
    joins: usize,
    leaves: usize,
    crashes: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    peers: usize,
    layers: u32,
    tracker_layers: u32,
    steps: usize,
    seed: u64,
    events: EventCounts,
    planner: StrategyReport,
    baseline: StrategyReport,
}

/// Per-strategy accumulators.
#[derive(Debug, Default)]
struct Tally {
    available_steps: usize,
    min_redundancy: Option<u32>,
    directives: Vec<f64>,
    bytes: Vec<f64>,
    times_ms: Vec<f64>,
    initial_ms: f64,
}

impl Tally {
    fn record(
        &mut self,
        model: &ModelShape,
        available: bool,
        directives: &[Directive],
        redundancy: u32,
        ms: f64,
    ) {
        if available {
            self.available_steps += 1;
        }
        self.min_redundancy = Some(
            self.min_redundancy
                .map_or(redundancy, |m| m.min(redundancy)),
        );
        self.directives.push(directives.len() as f64);
        self.bytes.push(
            directives
                .iter()
                .map(|d| d.bytes_loaded(model))
                .sum::<u64>() as f64,
        );
        self.times_ms.push(ms);
    }

    fn report(mut self, steps: usize) -> StrategyReport {
        let summary = |values: &[f64]| Summary {
            mean: if values.is_empty() {
                0.0
            } else {
                values.iter().sum::<f64>() / values.len() as f64
            },
            max: values.iter().copied().fold(0.0, f64::max),
        };
        self.times_ms.sort_by(f64::total_cmp);
        StrategyReport {
            availability: if steps == 0 {
                1.0
            } else {
                self.available_steps as f64 / steps as f64
            },
            min_redundancy: self.min_redundancy.unwrap_or(0),
            directives_per_event: summary(&self.directives),
            bytes_loaded_per_event: summary(&self.bytes),
            plan_time_ms: Percentiles {
                p50: self
                    .times_ms
                    .get(self.times_ms.len() / 2)
                    .copied()
                    .unwrap_or(0.0),
                max: self.times_ms.last().copied().unwrap_or(0.0),
            },
            initial_plan_ms: self.initial_ms,
        }
    }
}

fn elapsed_ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}

fn pick_event(rng: &mut StdRng, args: &Args) -> Event {
    // `validate` made the weights finite and non-negative with a positive sum.
    let weights = [args.join_rate, args.leave_rate, args.crash_rate];
    let total: f64 = weights.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return Event::Join;
    }
    let draw = rng.random_range(0.0..total);
    if draw < weights[0] {
        Event::Join
    } else if draw < weights[0] + weights[1] {
        Event::Leave
    } else {
        Event::Crash
    }
}

fn min_over(counts: &[u32], range: LayerSpan) -> u32 {
    counts
        .get(range.start as usize..range.end as usize)
        .and_then(|slice| slice.iter().copied().min())
        .unwrap_or(0)
}

/// Largest accepted `--peers`: keeps the simulated mesh within memory.
const MAX_PEERS: usize = 1_000_000;

/// Rejects arguments the simulation cannot run with, with a readable reason.
fn validate(args: &Args) -> Result<(), String> {
    for (name, rate) in [
        ("--join-rate", args.join_rate),
        ("--leave-rate", args.leave_rate),
        ("--crash-rate", args.crash_rate),
    ] {
        if !rate.is_finite() || rate < 0.0 {
            return Err(format!(
                "{name} must be a finite, non-negative weight, got {rate}"
            ));
        }
    }
    if args.join_rate + args.leave_rate + args.crash_rate <= 0.0 {
        return Err(
            "at least one of --join-rate, --leave-rate and --crash-rate must be positive".into(),
        );
    }
    if !(0.0..=1.0).contains(&args.cpu_fraction) {
        return Err(format!(
            "--cpu-fraction must lie in [0, 1], got {}",
            args.cpu_fraction
        ));
    }
    if args.peers > MAX_PEERS {
        return Err(format!(
            "--peers must be at most {MAX_PEERS}, got {}",
            args.peers
        ));
    }
    if let Some(layers) = args.layers
        && !(1..=MAX_LAYERS).contains(&layers)
    {
        return Err(format!(
            "--layers must lie in [1, {MAX_LAYERS}], got {layers}"
        ));
    }
    mesh_profile(args).validate().map_err(|e| e.to_string())?;
    planner_config(args).validate().map_err(|e| e.to_string())
}

/// The mesh profile (volunteer mix, tracker memory) the arguments ask for.
fn mesh_profile(args: &Args) -> MeshProfile {
    MeshProfile {
        cpu_fraction: args.cpu_fraction,
        tracker_gib: args.tracker_gib,
    }
}

/// The planner settings the arguments ask for.
fn planner_config(args: &Args) -> PlannerConfig {
    PlannerConfig {
        hysteresis: args.hysteresis,
        tracker_layers: args.tracker_layers,
    }
}

/// The chosen model's shape, with `--layers` layers when given.
fn simulated_model(args: &Args) -> ModelShape {
    let mut model = match args.model {
        ModelChoice::Llama70b => ModelShape::llama_70b(),
        ModelChoice::Smollm2_135m => ModelShape::smollm2_135m(),
    };
    if let Some(layers) = args.layers {
        model.num_layers = layers;
    }
    model
}

/// The layers redundancy is measured over: those volunteers serve, or all of
/// them if the tracker holds the whole model.
fn volunteer_layers(tracker_layers: u32, num_layers: u32) -> LayerSpan {
    if tracker_layers < num_layers {
        LayerSpan::new(tracker_layers, num_layers)
    } else {
        LayerSpan::new(0, num_layers)
    }
}

/// Both strategies replaying one churn trace over the same mesh.
struct Simulation<'a> {
    args: &'a Args,
    model: ModelShape,
    profile: MeshProfile,
    rng: StdRng,
    /// The live mesh; the tracker stays at index 0.
    peers: Vec<PeerCapacity>,
    /// Index of the next volunteer to join.
    next_id: usize,
    planner: Planner,
    /// The planner's coverage map, every span ready after each step.
    map: CoverageMap,
    baseline: GreedyBaseline,
    tracker_layers: u32,
    volunteer_layers: LayerSpan,
    ours: Tally,
    theirs: Tally,
    counts: EventCounts,
}

impl<'a> Simulation<'a> {
    /// Builds the initial mesh and places it with both strategies, timing each.
    fn start(args: &'a Args) -> Result<Self, String> {
        let model = simulated_model(args);
        let profile = mesh_profile(args);
        let mut rng = StdRng::seed_from_u64(args.seed);
        let peers: Vec<PeerCapacity> = scenario::mesh(&mut rng, args.peers, &profile);
        let planner = Planner::new(model.clone(), planner_config(args));

        let mut ours = Tally::default();
        let start = Instant::now();
        let initial = planner
            .plan(&CoverageMap::empty(0), &peers)
            .map_err(|e| e.to_string())?;
        ours.initial_ms = elapsed_ms(start);
        let tracker_layers = initial.tracker_layers;
        let mut map = initial.map;
        map.mark_all_ready();

        let mut theirs = Tally::default();
        let start = Instant::now();
        let mut baseline = GreedyBaseline::new(&model, tracker_layers, peers[0].throughput);
        for peer in peers.iter().filter(|p| !p.is_tracker) {
            baseline.join(&model, peer);
        }
        baseline.rebalance();
        theirs.initial_ms = elapsed_ms(start);

        Ok(Simulation {
            args,
            volunteer_layers: volunteer_layers(tracker_layers, model.num_layers),
            model,
            profile,
            rng,
            peers,
            next_id: args.peers,
            planner,
            map,
            baseline,
            tracker_layers,
            ours,
            theirs,
            counts: EventCounts {
                joins: 0,
                leaves: 0,
                crashes: 0,
            },
        })
    }

    /// Draws the next churn event (a join when no volunteer is left to go)
    /// and replays it.
    fn step(&mut self) -> Result<(), String> {
        let volunteers = self.peers.len() - 1;
        match pick_event(&mut self.rng, self.args) {
            Event::Leave | Event::Crash if volunteers == 0 => self.join(),
            Event::Join => self.join(),
            Event::Leave => self.depart(false),
            Event::Crash => self.depart(true),
        }
    }

    /// A new volunteer joins; both strategies place it.
    fn join(&mut self) -> Result<(), String> {
        self.counts.joins += 1;
        let id = scenario::volunteer_id(self.next_id);
        let peer = scenario::volunteer(&mut self.rng, id, &self.profile);
        self.next_id += 1;
        self.peers.push(peer.clone());

        let served_before = self.map.uncovered(self.model.num_layers).is_empty();
        self.replan(served_before)?;

        let served_before = self.baseline.is_complete();
        let start = Instant::now();
        let mut directives = self.baseline.join(&self.model, &peer);
        directives.extend(self.baseline.rebalance());
        let ms = elapsed_ms(start);
        self.record_baseline(served_before, &directives, ms);
        Ok(())
    }

    /// A random volunteer leaves cleanly or crashes; both strategies repair.
    fn depart(&mut self, crashed: bool) -> Result<(), String> {
        if crashed {
            self.counts.crashes += 1;
        } else {
            self.counts.leaves += 1;
        }
        let index = self.rng.random_range(1..self.peers.len());
        let gone: PeerId = self.peers.swap_remove(index).peer;

        // Both strategies are measured the same way: a crashed peer stops
        // serving at once, so "served before the repair" is judged without
        // it; a leaving one keeps serving until the repair has loaded, so it
        // is judged with it still in place.
        if crashed {
            self.map.remove_peer(&gone);
        }
        let served_before = self.map.uncovered(self.model.num_layers).is_empty();
        self.replan(served_before)?;

        // Petals-like servers have no coordinator: the layers are gone until
        // some server decides to move there.
        let complete_with_leaver = self.baseline.is_complete();
        self.baseline.remove(&gone);
        let served_before = if crashed {
            self.baseline.is_complete()
        } else {
            complete_with_leaver
        };
        let start = Instant::now();
        let directives = self.baseline.rebalance();
        let ms = elapsed_ms(start);
        self.record_baseline(served_before, &directives, ms);
        Ok(())
    }

    /// Replans the current mesh with the planner, records the step (available
    /// if the model was `served_before` and the plan covers it) and takes the
    /// plan's map, all of it ready, as the new state.
    fn replan(&mut self, served_before: bool) -> Result<(), String> {
        let start = Instant::now();
        let plan = self
            .planner
            .plan(&self.map, &self.peers)
            .map_err(|e| e.to_string())?;
        let ms = elapsed_ms(start);
        let available = served_before && plan.report.is_complete();
        let redundancy = plan.report.min_redundancy(self.volunteer_layers);
        self.ours
            .record(&self.model, available, &plan.directives, redundancy, ms);
        self.map = plan.map;
        self.map.mark_all_ready();
        Ok(())
    }

    /// Records a baseline step whose repair issued `directives` in `ms`.
    fn record_baseline(&mut self, served_before: bool, directives: &[Directive], ms: f64) {
        let available = served_before && self.baseline.is_complete();
        let redundancy = min_over(self.baseline.holders_per_layer(), self.volunteer_layers);
        self.theirs
            .record(&self.model, available, directives, redundancy, ms);
    }

    /// The report once every step has been replayed.
    fn into_report(self) -> Report {
        let steps = self.args.steps;
        Report {
            model: self.model.name,
            peers: self.args.peers,
            layers: self.model.num_layers,
            tracker_layers: self.tracker_layers,
            steps,
            seed: self.args.seed,
            events: self.counts,
            planner: self.ours.report(steps),
            baseline: self.theirs.report(steps),
        }
    }
}

/// Replays `--steps` churn events against both strategies.
fn run(args: &Args) -> Result<Report, String> {
    validate(args)?;
    let mut simulation = Simulation::start(args)?;
    for _ in 0..args.steps {
        simulation.step()?;
    }
    Ok(simulation.into_report())
}

fn print_table(report: &Report) {
    println!(
        "{} | {} peers | {} layers (tracker holds {}) | {} events ({} joins, {} leaves, {} crashes), seed {}",
        report.model,
        report.peers,
        report.layers,
        report.tracker_layers,
        report.steps,
        report.events.joins,
        report.events.leaves,
        report.events.crashes,
        report.seed
    );
    println!(
        "{:<10} {:>12} {:>9} {:>14} {:>14} {:>16} {:>16} {:>9} {:>9}",
        "strategy",
        "availability",
        "min red.",
        "directives/ev",
        "max dir./ev",
        "GB loaded/ev",
        "max GB/ev",
        "p50 ms",
        "max ms"
    );
    for (name, strategy) in [("planner", &report.planner), ("baseline", &report.baseline)] {
        println!(
            "{:<10} {:>12.4} {:>9} {:>14.2} {:>14.0} {:>16.3} {:>16.3} {:>9.3} {:>9.3}",
            name,
            strategy.availability,
            strategy.min_redundancy,
            strategy.directives_per_event.mean,
            strategy.directives_per_event.max,
            strategy.bytes_loaded_per_event.mean / 1e9,
            strategy.bytes_loaded_per_event.max / 1e9,
            strategy.plan_time_ms.p50,
            strategy.plan_time_ms.max
        );
    }
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(report) if args.json => match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(error) => {
                eprintln!("meshnet-sim: cannot encode the report: {error}");
                std::process::exit(1);
            }
        },
        Ok(report) => print_table(&report),
        Err(error) => {
            eprintln!("meshnet-sim: {error}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Args {
        let mut argv = vec!["meshnet-sim", "--peers", "6", "--steps", "20"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    }

    #[test]
    fn bad_arguments_are_reported_not_panicked_on() {
        for extra in [
            &["--join-rate", "NaN"][..],
            &["--leave-rate", "inf"],
            &["--crash-rate=-1"],
            &["--join-rate", "0", "--leave-rate", "0", "--crash-rate", "0"],
            &["--cpu-fraction", "1.5"],
            &["--cpu-fraction", "NaN"],
            &["--hysteresis", "0"],
            &["--hysteresis", "NaN"],
            &["--layers", "0"],
            &["--layers", "70000"],
            &["--tracker-gib", "18446744073709551615"],
        ] {
            let args = parse(extra);
            assert!(run(&args).is_err(), "{extra:?} was accepted");
        }
    }

    #[test]
    fn a_small_trace_runs_and_counts_every_event() {
        let report = run(&parse(&["--layers", "20"])).unwrap();
        assert_eq!(
            report.events.joins + report.events.leaves + report.events.crashes,
            20
        );
        for strategy in [&report.planner, &report.baseline] {
            assert!((0.0..=1.0).contains(&strategy.availability));
        }
    }
}
