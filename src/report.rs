//! `finetune report`: turn a finished (or interrupted) run folder into `report.html` and
//! `loss.png`, so a run can be judged, shared and compared without Python or a notebook.
//!
//! The plot answers "did it learn, and was the schedule right": training loss (and eval loss
//! where the run evaluated) against step with the learning rate on a second y axis, since most
//! loss kinks line up with warmup or decay; and loss against cumulative target tokens, the x
//! axis on which runs with different batch sizes or sequence lengths can be compared. The page
//! adds what the curve cannot show: throughput, peak memory and where it went, how much data
//! was truncated, dropped or bad (a falling loss on a silently cut data set is not success),
//! and the exact recipe that produced it.
//!
//! Text in the PNG is drawn with a font compiled into the binary (a Latin/Greek subset of
//! DejaVu Sans, `assets/`), through plotters' `ab_glyph` backend: CI machines and containers
//! have no system fonts and no fontconfig, and a plot with blank labels is worse than none.
//!
//! Both files are written to a temporary name and renamed, so a failure (a bad metrics line,
//! a full disk) leaves the previous report or none, never half of one.

use crate::error::{signal_name, Error, Result};
use crate::train::commas;
use plotters::prelude::*;
use serde::{Deserialize, Deserializer};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The PNG's size: two panels of ~420 px each under a title, wide enough for 1000+ steps.
pub const PNG_WIDTH: u32 = 1200;
pub const PNG_HEIGHT: u32 = 900;

/// DejaVu Sans cut to Latin-1, Greek, dashes, quotes and arrows (34 KB instead of 760 KB);
/// license in assets/DejaVuSans-LICENSE.
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");
/// Registered as plotters' "sans-serif", so text styled by plotters' defaults finds it too.
const FONT_FAMILY: &str = "sans-serif";

/// Where the report went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportPaths {
    pub html: PathBuf,
    pub png: PathBuf,
}

/// One line of metrics.jsonl (the fields the report uses; others are ignored so that newer
/// trainers can add fields without breaking older reports).
#[derive(Debug, Clone, Deserialize)]
struct StepRecord {
    step: usize,
    /// serde_json writes a NaN loss (a diverged step) as `null`; read it back as NaN so the
    /// report of a diverged run, the one most worth reading, can still be made.
    #[serde(deserialize_with = "f64_or_nan")]
    loss: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    lr: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    #[allow(dead_code)] // required by the format; not shown yet
    grad_norm: f64,
    tokens: usize,
    #[serde(deserialize_with = "f64_or_nan")]
    tokens_per_s: f64,
    /// Absent in metrics written before it was recorded.
    #[serde(default)]
    step_seconds: Option<f64>,
    #[serde(default)]
    eval_loss: Option<f64>,
    #[serde(default)]
    #[allow(dead_code)] // accepted so its type is checked; not shown yet
    wall_time: Option<f64>,
    #[serde(default)]
    rss_mb: Option<f64>,
}

fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// summary.json, written at the end of a run. Every key is optional: a run killed hard
/// never writes it, and older runs wrote fewer keys.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Summary {
    data: Option<DataStats>,
    peak_rss_mb: Option<f64>,
    memory: Option<MemoryAccount>,
    world_size: Option<usize>,
    /// The signal that stopped the run early; `null` when it ran to the end.
    interrupted: Option<i64>,
    cpu: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct DataStats {
    truncated: Option<u64>,
    dropped: Option<u64>,
    bad: Option<u64>,
    bad_examples: Vec<String>,
    /// What the counts are of (0 or absent: not counted by the run that wrote it).
    read: Option<u64>,
}

/// Bytes per account, as the memory plan counts them.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MemoryAccount {
    frozen: Option<u64>,
    gathered_peak: Option<u64>,
    lora_params: Option<u64>,
    lora_grads: Option<u64>,
    optimizer: Option<u64>,
}

/// Everything read from the run folder.
struct RunData {
    dir: PathBuf,
    steps: Vec<StepRecord>,
    /// `None` when the folder has no recipe.resolved.toml (metrics copied out of a run).
    recipe: Option<String>,
    /// `None` when the folder has no summary.json.
    summary: Option<Summary>,
}

/// Write `report.html` and `loss.png` into `run_dir`, from its metrics.jsonl,
/// recipe.resolved.toml and (when present) summary.json.
pub fn write_report(run_dir: &Path) -> Result<ReportPaths> {
    let run = read_run(run_dir)?;
    let paths = ReportPaths { html: run_dir.join("report.html"), png: run_dir.join("loss.png") };
    // Render both in memory first: a drawing failure must not leave a new PNG beside an old page.
    let png = render_png(&run.steps, &plot_title(&run.dir))
        .map_err(|msg| Error::Config { path: paths.png.clone(), msg: format!("cannot draw the loss plot: {msg}") })?;
    let html = render_html(&run);
    crate::fsutil::write_atomic(&paths.png, &png)?;
    crate::fsutil::write_atomic(&paths.html, html.as_bytes())?;
    Ok(paths)
}

// ---------------------------------------------------------------------------------------
// Reading

fn read_run(run_dir: &Path) -> Result<RunData> {
    let metrics_path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics_path).map_err(|e| Error::io(&metrics_path, e))?;
    let steps = parse_metrics(&metrics_path, &text)?;
    let recipe_path = run_dir.join("recipe.resolved.toml");
    let recipe = read_optional(&recipe_path)?;
    let summary_path = run_dir.join("summary.json");
    let summary = match read_optional(&summary_path)? {
        None => None,
        Some(s) => Some(serde_json::from_str::<Summary>(&s).map_err(|e| Error::Config {
            path: summary_path.clone(),
            msg: format!("expected a JSON object like {{\"data\": {{...}}, \"peak_rss_mb\": ..., \"memory\": {{...}}}}: {e}"),
        })?),
    };
    // The absolute path names the run better than "." or "out" would.
    let dir = std::fs::canonicalize(run_dir).unwrap_or_else(|_| run_dir.to_path_buf());
    Ok(RunData { dir, steps, recipe, summary })
}

/// A file's text, or `None` when it does not exist (any other failure is an error).
fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn parse_metrics(path: &Path, text: &str) -> Result<Vec<StepRecord>> {
    let mut steps: Vec<StepRecord> = Vec::new();
    let mut last_line = 0;
    let lines = text.lines().count();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        // A last line without its newline that does not parse was cut short by a crash or a
        // full disk mid-write (a resume cuts it): the steps before it still plot.
        let cut_short = i + 1 == lines && !text.ends_with('\n');
        if cut_short && serde_json::from_str::<StepRecord>(line).is_err() {
            crate::note!("note: {}: line {} is cut short (the run stopped while writing it): left out", path.display(), i + 1);
            continue;
        }
        let rec: StepRecord = serde_json::from_str(line).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: format!(
                "line {}: expected one JSON object per step with step, loss, lr, grad_norm, tokens, tokens_per_s \
                 (eval_loss, wall_time, rss_mb optional): {e}",
                i + 1
            ),
        })?;
        // A run writes each step once, in order (a resume cuts the lines past its checkpoint
        // first); lines out of order are two runs' logs put together, plotted as one zigzag.
        if let Some(prev) = steps.last().filter(|p| p.step >= rec.step) {
            return Err(Error::Config {
                path: path.to_path_buf(),
                msg: format!("line {}: step {} after step {} (line {last_line}): steps must increase, one line each", i + 1, rec.step, prev.step),
            });
        }
        last_line = i + 1;
        steps.push(rec);
    }
    if steps.is_empty() {
        return Err(Error::Config {
            path: path.to_path_buf(),
            msg: "no steps recorded (expected one JSON line per optimizer step); did the run finish its first step?".into(),
        });
    }
    Ok(steps)
}

// ---------------------------------------------------------------------------------------
// Plot

type DrawResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;
type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// Width of the learning-rate axis on the right of the top panel.
const RIGHT_AXIS_WIDTH: u32 = 88;
const LOSS_COLOR: RGBColor = RGBColor(31, 119, 180);
const EVAL_COLOR: RGBColor = RGBColor(214, 39, 40);
const LR_COLOR: RGBColor = RGBColor(255, 127, 14);

fn plot_title(dir: &Path) -> String {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string());
    format!("finetune run: {name}")
}

fn register_font() -> std::result::Result<(), String> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok { Ok(()) } else { Err("the built-in font does not parse".into()) }
}

/// Draw both panels into an RGB buffer and encode it as PNG bytes.
fn render_png(steps: &[StepRecord], title: &str) -> std::result::Result<Vec<u8>, String> {
    register_font()?;
    let mut rgb = vec![0u8; (PNG_WIDTH * PNG_HEIGHT * 3) as usize];
    draw_panels(&mut rgb, steps, title).map_err(|e| e.to_string())?;
    encode_png(&rgb, PNG_WIDTH, PNG_HEIGHT).map_err(|e| format!("encoding the PNG: {e}"))
}

fn draw_panels(rgb: &mut [u8], steps: &[StepRecord], title: &str) -> DrawResult {
    let root = BitMapBackend::with_buffer(rgb, (PNG_WIDTH, PNG_HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    // A top margin keeps the title's ascenders off the image edge.
    let root = root.margin(10, 0, 0, 0).titled(title, (FONT_FAMILY, 28))?;
    let (top, bottom) = root.split_vertically(root.dim_in_pixel().1 / 2);
    draw_step_panel(&top, steps)?;
    draw_token_panel(&bottom, steps)?;
    root.present()?;
    Ok(())
}

/// Loss and eval loss against step, learning rate on the right axis.
fn draw_step_panel(area: &Area, steps: &[StepRecord]) -> DrawResult {
    let x = padded_range(steps.iter().map(|s| s.step as f64), 0.0);
    let loss = loss_range(steps);
    let lr_max = steps.iter().map(|s| s.lr).filter(|v| v.is_finite()).fold(0.0, f64::max);
    let lr_top = if lr_max > 0.0 { lr_max * 1.1 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption("Loss and learning rate by step", (FONT_FAMILY, 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .right_y_label_area_size(RIGHT_AXIS_WIDTH)
        .build_cartesian_2d(x.clone(), loss)?
        .set_secondary_coord(x, 0.0..lr_top);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .label_style((FONT_FAMILY, 15))
        .axis_desc_style((FONT_FAMILY, 17))
        // Steps are whole: a short run's fractional ticks (1.2, 1.4) get no label.
        .x_label_formatter(&|v| if (v - v.round()).abs() < 1e-6 { format!("{v:.0}") } else { String::new() })
        .y_label_formatter(&|v| format!("{v:.2}"))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc("learning rate")
        .label_style((FONT_FAMILY, 15).into_font().color(&LR_COLOR))
        .axis_desc_style((FONT_FAMILY, 17).into_font().color(&LR_COLOR))
        .y_label_formatter(&|v| if *v == 0.0 { "0".into() } else { format!("{v:.1e}") })
        .draw()?;
    let train = finite(steps.iter().map(|s| (s.step as f64, s.loss)));
    draw_loss_series(&mut chart, train, eval_points(steps, |s| s.step as f64))?;
    chart
        .draw_secondary_series(DashedLineSeries::new(
            finite(steps.iter().map(|s| (s.step as f64, s.lr))),
            6,
            4,
            LR_COLOR.stroke_width(2),
        ))?
        .label("learning rate (right axis)")
        .legend(|(x, y)| {
            // Dashed in the legend too, as on the plot.
            EmptyElement::at((x, y))
                + PathElement::new(vec![(0, 0), (9, 0)], LR_COLOR.stroke_width(2))
                + PathElement::new(vec![(15, 0), (24, 0)], LR_COLOR.stroke_width(2))
        });
    draw_legend(&mut chart)
}

/// Loss against cumulative target tokens: the x axis on which runs with different batch
/// sizes compare.
fn draw_token_panel(area: &Area, steps: &[StepRecord]) -> DrawResult {
    let cum: Vec<f64> = steps
        .iter()
        .scan(0u64, |acc, s| {
            *acc += s.tokens as u64;
            Some(*acc as f64)
        })
        .collect();
    let x = padded_range(cum.iter().copied(), 0.0);
    let mut chart = ChartBuilder::on(area)
        .caption("Loss by cumulative target tokens", (FONT_FAMILY, 20))
        .margin(12)
        // No right axis here, but the same right inset as the top panel so the plots line up.
        .margin_right(12 + RIGHT_AXIS_WIDTH)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x, loss_range(steps))?;
    chart
        .configure_mesh()
        .x_desc("target tokens (cumulative)")
        .y_desc("loss")
        .label_style((FONT_FAMILY, 15))
        .axis_desc_style((FONT_FAMILY, 17))
        .x_label_formatter(&|v| human_count(*v))
        .y_label_formatter(&|v| format!("{v:.2}"))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .draw()?;
    let train = finite(cum.iter().zip(steps).map(|(&t, s)| (t, s.loss)));
    let eval = finite(cum.iter().zip(steps).filter_map(|(&t, s)| s.eval_loss.map(|l| (t, l))));
    draw_loss_series(&mut chart, train, eval)?;
    draw_legend(&mut chart)
}

fn draw_loss_series<'a, DB: DrawingBackend + 'a>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>>,
    train: Vec<(f64, f64)>,
    eval: Vec<(f64, f64)>,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    // Per-step loss is noisy (one batch each); past a few dozen steps the trend is what one
    // reads, so draw the raw curve faint under an exponential moving average.
    let smooth = train.len() >= SMOOTH_FROM;
    let raw_style = if smooth { LOSS_COLOR.mix(0.5).stroke_width(1) } else { LOSS_COLOR.stroke_width(2) };
    chart
        .draw_series(LineSeries::new(train.clone(), raw_style))?
        .label("train loss")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], raw_style));
    if smooth {
        chart
            .draw_series(LineSeries::new(ema(&train), LOSS_COLOR.stroke_width(2)))?
            .label("train loss, moving average")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], LOSS_COLOR.stroke_width(2)));
    }
    // A single step is a point, not a line: mark it so one-step runs show something.
    if train.len() == 1 {
        chart.draw_series(train.iter().map(|&p| Circle::new(p, 4, LOSS_COLOR.filled())))?;
    }
    if !eval.is_empty() {
        // Markers shrink as evals crowd, so a long run's eval curve stays a curve.
        let r = if eval.len() > 60 { 2 } else if eval.len() > 25 { 3 } else { 5 };
        chart.draw_series(LineSeries::new(eval.clone(), EVAL_COLOR.stroke_width(2)))?;
        chart
            .draw_series(eval.iter().map(|&p| Circle::new(p, r, EVAL_COLOR.filled())))?
            .label("eval loss")
            .legend(|(x, y)| {
                EmptyElement::at((x + 12, y))
                    + PathElement::new(vec![(-12, 0), (12, 0)], EVAL_COLOR.stroke_width(2))
                    + Circle::new((0, 0), 5, EVAL_COLOR.filled())
            });
    }
    Ok(())
}

fn draw_legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(chart: &mut ChartContext<'a, DB, CT>) -> DrawResult
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .margin(10)
        .label_font((FONT_FAMILY, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    Ok(())
}

/// Steps from which the loss curve gets a moving average.
const SMOOTH_FROM: usize = 40;

/// Exponential moving average over a window of ~1/20 of the run (at least 5 points), with
/// TensorBoard's debiasing so the first points are not pulled towards zero.
fn ema(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let window = (points.len() as f64 / 20.0).max(5.0);
    let alpha = 2.0 / (window + 1.0);
    let (mut avg, mut weight) = (0.0, 0.0);
    points
        .iter()
        .map(|&(x, y)| {
            avg = (1.0 - alpha) * avg + alpha * y;
            weight = (1.0 - alpha) * weight + alpha;
            (x, avg / weight)
        })
        .collect()
}

fn eval_points(steps: &[StepRecord], x: impl Fn(&StepRecord) -> f64) -> Vec<(f64, f64)> {
    finite(steps.iter().filter_map(|s| s.eval_loss.map(|l| (x(s), l))))
}

/// Points with both coordinates finite (a diverged step's NaN loss is left out, not drawn
/// as a spike to infinity that would flatten the rest of the curve).
fn finite(points: impl Iterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    points.filter(|&(x, y)| plottable(x) && plottable(y)).collect()
}

/// A value the plot can place: finite and at most 1e30 in magnitude. Past that a range's
/// span overflows to infinity (1e308 - -1e308), and plotters then never finishes placing its
/// tick marks; a loss that large is a diverged run, shown in the table, not on the axis.
fn plottable(v: f64) -> bool {
    v.is_finite() && v.abs() <= 1e30
}

fn loss_range(steps: &[StepRecord]) -> std::ops::Range<f64> {
    let values = || steps.iter().flat_map(|s| std::iter::once(s.loss).chain(s.eval_loss)).filter(|&v| plottable(v));
    let r = padded_range(values(), 0.05);
    // Cross-entropy is never negative: padding must not put the axis below zero.
    let start = if values().all(|v| v >= 0.0) { r.start.max(0.0) } else { r.start };
    start..r.end
}

/// min..max of the plottable values, widened by `pad` of the span (and to 0..2v when all values
/// are equal, e.g. a one-step run, since plotters needs a non-empty range).
fn padded_range(values: impl Iterator<Item = f64>, pad: f64) -> std::ops::Range<f64> {
    let (lo, hi) = values.filter(|&v| plottable(v)).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let span = hi - lo;
    if span <= f64::EPSILON * hi.abs().max(1.0) {
        // Centre the lone value on a range from zero, so the ticks are round numbers.
        return if lo > 0.0 { 0.0..2.0 * lo } else { (lo - 0.5)..(hi + 0.5) };
    }
    (lo - pad * span)..(hi + pad * span)
}

fn encode_png(rgb: &[u8], width: u32, height: u32) -> std::result::Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// HTML

/// Figures for the summary table, computed once so tests can check them without parsing HTML.
#[derive(Debug, PartialEq)]
struct Totals {
    steps: usize,
    last_step: usize,
    final_loss: f64,
    min_loss: Option<(usize, f64)>,
    last_eval: Option<(usize, f64)>,
    tokens: u64,
    /// Tokens per second over the steps, leaving out the first step when there are others: it
    /// carries one-off costs (allocation, page faults of the mapped weights). The tokens the
    /// steps processed over the seconds they took; for metrics without `step_seconds`, the
    /// mean of the steps' rates (which fast steps pull up).
    mean_tokens_per_s: Option<f64>,
    peak_rss_mb: Option<f64>,
}

fn totals(steps: &[StepRecord], summary: Option<&Summary>) -> Totals {
    let last = steps.last().expect("parse_metrics returns at least one step");
    let min_loss = steps.iter().filter(|s| s.loss.is_finite()).min_by(|a, b| a.loss.total_cmp(&b.loss)).map(|s| (s.step, s.loss));
    let last_eval = steps.iter().rev().find_map(|s| s.eval_loss.map(|l| (s.step, l)));
    let timed = if steps.len() > 1 { &steps[1..] } else { steps };
    let rates: Vec<f64> = timed.iter().map(|s| s.tokens_per_s).filter(|v| v.is_finite()).collect();
    let timings: Option<Vec<(f64, f64)>> = timed.iter().map(|s| s.step_seconds.filter(|t| t.is_finite() && *t > 0.0 && s.tokens_per_s.is_finite()).map(|t| (s.tokens_per_s * t, t))).collect();
    let mean_tokens_per_s = match timings {
        Some(t) if !t.is_empty() => Some(t.iter().map(|p| p.0).sum::<f64>() / t.iter().map(|p| p.1).sum::<f64>()),
        _ => (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64),
    };
    let max_rss = steps.iter().filter_map(|s| s.rss_mb).filter(|v| v.is_finite()).reduce(f64::max);
    Totals {
        steps: steps.len(),
        last_step: last.step,
        final_loss: last.loss,
        min_loss,
        last_eval,
        tokens: steps.iter().map(|s| s.tokens as u64).sum(),
        mean_tokens_per_s,
        peak_rss_mb: summary.and_then(|s| s.peak_rss_mb).or(max_rss),
    }
}

fn render_html(run: &RunData) -> String {
    let t = totals(&run.steps, run.summary.as_ref());
    let dir = esc(&run.dir.display().to_string());
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>finetune report: {dir}</title>\n\
         <style>{CSS}</style>\n</head>\n<body>\n<h1>finetune report</h1>\n<p class=\"dir\">{dir}</p>\n\
         <img src=\"loss.png\" width=\"{PNG_WIDTH}\" height=\"{PNG_HEIGHT}\" alt=\"training loss, eval loss and learning rate by step; loss by cumulative target tokens\">\n"
    );
    summary_table(&mut h, &t, run.summary.as_ref());
    data_section(&mut h, run.summary.as_ref());
    h.push_str("<h2>Recipe</h2>\n");
    match &run.recipe {
        Some(r) => {
            let _ = writeln!(h, "<pre>{}</pre>", esc(r));
        }
        None => h.push_str("<p class=\"na\">No recipe.resolved.toml in the run folder.</p>\n"),
    }
    h.push_str("</body>\n</html>\n");
    h
}

const CSS: &str = "body{font-family:system-ui,sans-serif;max-width:1240px;margin:2em auto;padding:0 1em;color:#222}\
h1{margin-bottom:0}.dir{font-family:monospace;color:#555;margin-top:.3em}\
img{max-width:100%;height:auto;border:1px solid #ddd}\
table{border-collapse:collapse;margin:.5em 0}td,th{padding:.25em .9em;border-bottom:1px solid #eee;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}th{font-weight:600;background:#f6f6f6}\
pre{background:#f6f6f6;padding:1em;overflow-x:auto}.na{color:#888}.warn{color:#b00}";

fn summary_table(h: &mut String, t: &Totals, summary: Option<&Summary>) {
    let na = || "<span class=\"na\">n/a</span>".to_string();
    let mut rows: Vec<(&str, String)> = vec![
        ("steps", format!("{} (last step {})", t.steps, t.last_step)),
        ("final loss", fmt_loss(t.final_loss)),
        ("min loss", t.min_loss.map(|(s, l)| format!("{} (step {s})", fmt_loss(l))).unwrap_or_else(na)),
        ("last eval loss", t.last_eval.map(|(s, l)| format!("{} (step {s})", fmt_loss(l))).unwrap_or_else(na)),
        ("target tokens", commas(t.tokens)),
        ("tokens/s", t.mean_tokens_per_s.map(|v| format!("{v:.0}")).unwrap_or_else(na)),
        ("peak RSS", t.peak_rss_mb.map(|v| format!("{} MiB", commas(v.max(0.0).round() as u64))).unwrap_or_else(na)),
    ];
    let s = summary;
    rows.push(("world size", s.and_then(|s| s.world_size).map(|w| w.to_string()).unwrap_or_else(na)));
    rows.push(("CPU", s.and_then(|s| s.cpu.as_deref()).map(esc).unwrap_or_else(na)));
    let interrupted = match s {
        // A run writes summary.json when it ends, signalled or not: without it, it has not
        // ended (still running) or did not end cleanly (killed, or stopped by an error such
        // as a NaN loss).
        None => "<span class=\"warn\">no summary.json: still running, or killed or stopped by an error</span>".into(),
        Some(Summary { interrupted: None, .. }) => "no, ran to the end".into(),
        Some(Summary { interrupted: Some(sig), .. }) => format!("<span class=\"warn\">yes, by {}</span>", signal_name(*sig)),
    };
    rows.push(("interrupted", interrupted));
    h.push_str("<h2>Summary</h2>\n<table>\n");
    for (k, v) in rows {
        let _ = writeln!(h, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    h.push_str("</table>\n");
    memory_table(h, summary.and_then(|s| s.memory.as_ref()));
}

fn memory_table(h: &mut String, mem: Option<&MemoryAccount>) {
    h.push_str("<h2>Memory account</h2>\n");
    let Some(m) = mem else {
        h.push_str("<p class=\"na\">Not recorded (no memory account in summary.json).</p>\n");
        return;
    };
    let rows = [
        ("frozen base weights", m.frozen),
        ("gathered layers, peak", m.gathered_peak),
        ("LoRA parameters", m.lora_params),
        ("LoRA gradients", m.lora_grads),
        ("optimizer state", m.optimizer),
    ];
    h.push_str("<table>\n");
    for (k, v) in rows {
        let v = v.map(fmt_bytes).unwrap_or_else(|| "<span class=\"na\">n/a</span>".into());
        let _ = writeln!(h, "<tr><th>{k}</th><td class=\"n\">{v}</td></tr>");
    }
    let total: u64 = rows.iter().filter_map(|(_, v)| *v).sum();
    let _ = writeln!(h, "<tr><th>total</th><td class=\"n\"><b>{}</b></td></tr>\n</table>", fmt_bytes(total));
}

fn data_section(h: &mut String, summary: Option<&Summary>) {
    h.push_str("<h2>Data</h2>\n");
    let Some(d) = summary.and_then(|s| s.data.as_ref()) else {
        h.push_str("<p class=\"na\">Not recorded (no data statistics in summary.json).</p>\n");
        return;
    };
    let count = |v: Option<u64>| v.map(commas).unwrap_or_else(|| "<span class=\"na\">n/a</span>".into());
    let _ = writeln!(
        h,
        "<table>\n<tr><th>records read (first pass)</th><td class=\"n\">{}</td></tr>\n<tr><th>truncated to max length</th><td class=\"n\">{}</td></tr>\n\
         <tr><th>dropped</th><td class=\"n\">{}</td></tr>\n<tr><th>bad records</th><td class=\"n\">{}</td></tr>\n</table>",
        count(d.read.filter(|&n| n > 0)),
        count(d.truncated),
        count(d.dropped),
        count(d.bad)
    );
    if !d.bad_examples.is_empty() {
        h.push_str("<p>Bad records, first examples:</p>\n<ul>\n");
        for e in &d.bad_examples {
            let _ = writeln!(h, "<li><code>{}</code></li>", esc(e));
        }
        h.push_str("</ul>\n");
    }
}

fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn fmt_loss(v: f64) -> String {
    if v.is_finite() { format!("{v:.4}") } else { "<span class=\"warn\">NaN (diverged)</span>".into() }
}

fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// Axis ticks for token counts: 0, 500, 12.5k, 100k, 1.25M.
fn human_count(v: f64) -> String {
    let a = v.abs();
    let (x, unit) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "k")
    } else {
        return format!("{v:.0}");
    };
    let digits = format!("{x:.2}");
    format!("{}{unit}", digits.trim_end_matches('0').trim_end_matches('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics_line(step: usize, loss: f64, eval: Option<f64>) -> String {
        let eval = eval.map(|e| format!(", \"eval_loss\": {e}")).unwrap_or_default();
        format!(
            "{{\"step\": {step}, \"loss\": {loss}, \"lr\": 0.0002, \"grad_norm\": 1.5, \"tokens\": 100, \
             \"tokens_per_s\": {}, \"rss_mb\": {}{eval}}}\n",
            if step == 1 { 10.0 } else { 1000.0 },
            500.0 + step as f64
        )
    }

    fn run_dir(metrics: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), metrics).unwrap();
        std::fs::write(dir.path().join("recipe.resolved.toml"), "[train]\nlr = 2e-4\nname = \"<b>&\"\n").unwrap();
        dir
    }

    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        (be(&bytes[16..20]), be(&bytes[20..24]))
    }

    /// Losses of a diverged run (±1e308) are left off the axes, which stay finite: the report
    /// is written instead of plotters looping forever on an infinite range.
    #[test]
    fn a_loss_too_large_to_plot_still_gives_a_report() {
        for (a, b) in [(1e308, 1e308), (1e308, -1e308), (2.0, 1e300)] {
            let metrics = [metrics_line(1, a, None), metrics_line(2, b, Some(a))].concat();
            let steps = parse_metrics(Path::new("metrics.jsonl"), &metrics).unwrap();
            let r = loss_range(&steps);
            assert!(r.start.is_finite() && r.end.is_finite() && (r.end - r.start).is_finite() && r.start < r.end, "{a} {b}: {r:?}");
            let dir = run_dir(&metrics);
            write_report(dir.path()).unwrap();
            assert!(dir.path().join("loss.png").is_file());
        }
    }

    #[test]
    fn report_of_a_run_writes_html_and_a_png() {
        let metrics: String = (1..=20).map(|s| metrics_line(s, 2.5 - s as f64 * 0.05, (s % 5 == 0).then_some(2.4 - s as f64 * 0.04))).collect();
        let dir = run_dir(&metrics);
        let summary = r#"{"data": {"truncated": 3, "dropped": 1, "bad": 2, "bad_examples": ["line 7: missing <messages>"]},
            "peak_rss_mb": 1234.4, "memory": {"frozen": 1073741824, "lora_params": 1048576},
            "world_size": 2, "interrupted": null, "cpu": "AMD EPYC", "future_key": [1, 2]}"#;
        std::fs::write(dir.path().join("summary.json"), summary).unwrap();
        let paths = write_report(dir.path()).unwrap();
        assert_eq!(paths, ReportPaths { html: dir.path().join("report.html"), png: dir.path().join("loss.png") });
        let png = std::fs::read(&paths.png).unwrap();
        assert_eq!(png_size(&png), (PNG_WIDTH, PNG_HEIGHT));
        let html = std::fs::read_to_string(&paths.html).unwrap();
        for want in ["<img src=\"loss.png\"", "1.5000", "1,234 MiB", "1.00 GiB", "line 7: missing &lt;messages&gt;", "AMD EPYC", "ran to the end"] {
            assert!(html.contains(want), "report.html lacks {want:?}:\n{html}");
        }
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".tmp")).collect();
        assert!(leftovers.is_empty(), "temporary files left behind: {leftovers:?}");
    }

    #[test]
    fn the_recipe_is_shown_verbatim_and_html_escaped() {
        let dir = run_dir(&metrics_line(1, 2.0, None));
        let html = std::fs::read_to_string(write_report(dir.path()).unwrap().html).unwrap();
        assert!(html.contains("<pre>[train]\nlr = 2e-4\nname = &quot;&lt;b&gt;&amp;&quot;\n</pre>"), "{html}");
    }

    #[test]
    fn a_metrics_line_that_is_not_json_names_the_file_and_line() {
        let dir = run_dir(&format!("{}not json\n", metrics_line(1, 2.0, None)));
        let err = write_report(dir.path()).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl") && err.contains("line 2") && err.contains("expected one JSON object"), "{err}");
    }

    #[test]
    fn a_last_metrics_line_cut_short_is_left_out_not_the_whole_report() {
        let two = format!("{}{}", metrics_line(1, 2.0, None), metrics_line(2, 1.5, None));
        let cut = format!("{two}{}", &metrics_line(3, 1.0, None)[..20]);
        assert_eq!(parse_metrics(Path::new("metrics.jsonl"), &cut).unwrap().len(), 2);
        // With its newline it was written whole: a damaged file, refused.
        assert!(parse_metrics(Path::new("metrics.jsonl"), &format!("{cut}\n")).is_err());
    }

    #[test]
    fn a_step_written_twice_or_out_of_order_names_both_lines() {
        for (second, word) in [(1, "step 1 after step 1"), (0, "step 0 after step 1")] {
            let dir = run_dir(&format!("{}{}", metrics_line(1, 2.0, None), metrics_line(second, 1.0, None)));
            let err = write_report(dir.path()).unwrap_err().to_string();
            assert!(err.contains("metrics.jsonl") && err.contains(&format!("line 2: {word} (line 1)")), "{err}");
        }
    }

    #[test]
    fn a_metrics_line_missing_a_field_says_which() {
        let dir = run_dir("{\"step\": 1, \"loss\": 2.0}\n");
        let err = write_report(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("missing field `lr`"), "{err}");
    }

    #[test]
    fn a_missing_metrics_file_is_an_io_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_report(dir.path()).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("metrics.jsonl"), "{err}");
    }

    #[test]
    fn an_empty_metrics_file_says_no_steps_were_recorded() {
        let dir = run_dir("\n\n");
        let err = write_report(dir.path()).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl") && err.contains("no steps recorded"), "{err}");
    }

    #[test]
    fn a_failed_report_leaves_no_output_behind() {
        let dir = run_dir("{\"step\": 1,\n");
        assert!(write_report(dir.path()).is_err());
        let names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(!names.iter().any(|n| n.contains("report") || n.contains("loss.png")), "{names:?}");
    }

    #[test]
    fn mean_tokens_per_s_leaves_out_the_first_step_and_peak_rss_falls_back_to_the_metrics() {
        let text: String = (1..=4).map(|s| metrics_line(s, 2.0, None)).collect();
        let steps = parse_metrics(Path::new("metrics.jsonl"), &text).unwrap();
        let t = totals(&steps, None);
        assert_eq!(t.mean_tokens_per_s, Some(1000.0));
        assert_eq!(t.peak_rss_mb, Some(504.0));
        assert_eq!(t.tokens, 400);
        let one = totals(&steps[..1], None);
        assert_eq!(one.mean_tokens_per_s, Some(10.0), "a one-step run has only its first step to average");
    }

    /// Throughput is the tokens over the seconds: a fast step counts for its short time, not
    /// as one rate among equals.
    #[test]
    fn tokens_per_s_is_the_tokens_over_the_time_the_steps_took() {
        let line = |step: usize, rate: f64, secs: f64| {
            format!("{{\"step\": {step}, \"loss\": 1.0, \"lr\": 0.1, \"grad_norm\": 1.0, \"tokens\": 5, \"tokens_per_s\": {rate}, \"step_seconds\": {secs}}}\n")
        };
        // Step 1 left out; then 1000 tokens in 1 s and 1000 tokens in 0.1 s: 2000 / 1.1 s.
        let text = [line(1, 1.0, 50.0), line(2, 1000.0, 1.0), line(3, 10000.0, 0.1)].concat();
        let t = totals(&parse_metrics(Path::new("metrics.jsonl"), &text).unwrap(), None);
        assert!((t.mean_tokens_per_s.unwrap() - 2000.0 / 1.1).abs() < 1e-9, "{:?}", t.mean_tokens_per_s);
    }

    #[test]
    fn unknown_metrics_fields_are_ignored_and_a_null_loss_reads_as_nan() {
        let text = "{\"step\": 1, \"loss\": null, \"lr\": 0.1, \"grad_norm\": 1.0, \"tokens\": 5, \"tokens_per_s\": 9.0, \"new_thing\": {\"a\": 1}}\n";
        let steps = parse_metrics(Path::new("metrics.jsonl"), text).unwrap();
        assert!(steps[0].loss.is_nan());
    }

    #[test]
    fn a_one_step_run_without_summary_still_gets_a_report() {
        let dir = run_dir(&metrics_line(1, 2.0, Some(2.1)));
        std::fs::remove_file(dir.path().join("recipe.resolved.toml")).unwrap();
        let paths = write_report(dir.path()).unwrap();
        assert_eq!(png_size(&std::fs::read(&paths.png).unwrap()), (PNG_WIDTH, PNG_HEIGHT));
        let html = std::fs::read_to_string(&paths.html).unwrap();
        assert!(html.contains("No recipe.resolved.toml") && html.contains("no memory account"), "{html}");
        // Killed or stopped by an error is not "n/a".
        assert!(html.contains("no summary.json: still running, or killed or stopped by an error"), "{html}");
    }

    #[test]
    fn a_summary_json_that_is_not_json_names_the_file() {
        let dir = run_dir(&metrics_line(1, 2.0, None));
        std::fs::write(dir.path().join("summary.json"), "{oops").unwrap();
        let err = write_report(dir.path()).unwrap_err().to_string();
        assert!(err.contains("summary.json"), "{err}");
    }

    #[test]
    fn the_plot_has_text_drawn_with_the_built_in_font() {
        // Guards the fresh-machine case: with no font, plotters' ab_glyph backend fails or draws
        // nothing, so the title band (above both charts) would be blank.
        register_font().unwrap();
        let steps = parse_metrics(Path::new("m"), &metrics_line(1, 2.0, None)).unwrap();
        let mut rgb = vec![0u8; (PNG_WIDTH * PNG_HEIGHT * 3) as usize];
        draw_panels(&mut rgb, &steps, "finetune run: x").unwrap();
        let dark = rgb[..(PNG_WIDTH * 30 * 3) as usize].chunks(3).filter(|p| p.iter().all(|&c| c < 128)).count();
        assert!(dark > 50, "title band has {dark} dark pixels");
    }

    #[test]
    fn the_moving_average_of_a_constant_is_that_constant() {
        let pts: Vec<(f64, f64)> = (0..50).map(|i| (i as f64, 1.5)).collect();
        assert!(ema(&pts).iter().all(|&(_, y)| (y - 1.5).abs() < 1e-12));
    }

    #[test]
    fn digits_group_and_bytes_scale() {
        assert_eq!(commas(1234567), "1,234,567");
        assert_eq!(commas(12), "12");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(human_count(12_500.0), "12.5k");
        assert_eq!(human_count(100_000.0), "100k");
        assert_eq!(human_count(1_250_000.0), "1.25M");
    }
}
