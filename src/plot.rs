//! The loss curve: line series on labelled axes with a legend, drawn into an RGB buffer and
//! written as a compressed PNG (the `png` crate). Text uses the public-domain 8x8 bitmap font of
//! `font8x8`, compiled in: no system font, no font library, the same picture on every machine.
use std::path::Path;

/// One curve: `(x, y)` points in order, its colour and its legend label.
pub struct Series<'a> {
    pub points: &'a [(f64, f64)],
    pub rgb: [u8; 3],
    pub label: &'a str,
}

/// A line chart: title, axis labels and the series drawn on shared axes.
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: Vec<Series<'a>>,
}

const BLACK: [u8; 3] = [40, 40, 40];
const GRID: [u8; 3] = [228, 228, 228];
const GLYPH: i64 = 8;

/// An RGB canvas; every write is clipped to it.
struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn put(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn hline(&mut self, x0: i64, x1: i64, y: i64, c: [u8; 3]) {
        (x0..=x1).for_each(|x| self.put(x, y, c));
    }

    fn vline(&mut self, x: i64, y0: i64, y1: i64, c: [u8; 3]) {
        (y0..=y1).for_each(|y| self.put(x, y, c));
    }

    /// A 2-pixel-thick segment (DDA: one sample per pixel along the longer axis).
    fn segment(&mut self, a: (f64, f64), b: (f64, f64), c: [u8; 3]) {
        let n = ((b.0 - a.0).abs().max((b.1 - a.1).abs()).ceil() as usize).max(1);
        for t in 0..=n {
            let f = t as f64 / n as f64;
            let (x, y) = ((a.0 + f * (b.0 - a.0)).round() as i64, (a.1 + f * (b.1 - a.1)).round() as i64);
            self.put(x, y, c);
            self.put(x, y + 1, c);
        }
    }

    /// `text` in the 8x8 font with its top-left corner at (x, y); `vertical` writes it bottom
    /// to top (the y-axis label), so (x, y) is then the bottom-left corner.
    fn text(&mut self, x: i64, y: i64, text: &str, c: [u8; 3], vertical: bool) {
        for (i, ch) in text.chars().enumerate() {
            let glyph = font8x8::legacy::BASIC_LEGACY.get(ch as usize).copied().unwrap_or(font8x8::legacy::BASIC_LEGACY['?' as usize]);
            let off = i as i64 * GLYPH;
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits >> col & 1 == 1 {
                        let (r, k) = (row as i64, col as i64);
                        if vertical {
                            self.put(x + r, y - off - k, c);
                        } else {
                            self.put(x + off + k, y + r, c);
                        }
                    }
                }
            }
        }
    }
}

fn text_width(s: &str) -> i64 {
    s.chars().count() as i64 * GLYPH
}

/// About `target` round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi].
fn ticks(lo: f64, hi: f64, target: usize) -> (Vec<f64>, f64) {
    let raw = (hi - lo) / target as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| raw <= *s).unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    ((first..=last).map(|k| k as f64 * step).collect(), step)
}

/// A tick label with as many decimals as the tick spacing needs.
fn tick_label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize };
    let s = format!("{v:.decimals$}");
    if s == "-0" {
        "0".into()
    } else {
        s
    }
}

impl Chart<'_> {
    /// The chart as `w` x `h` RGB pixels (row-major, 3 bytes a pixel).
    pub fn render(&self, w: usize, h: usize) -> Vec<u8> {
        let mut cv = Canvas { w, h, px: vec![255u8; w * h * 3] };
        let pts = || self.series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in pts() {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if x0 > x1 {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if x1 - x0 < 1e-9 {
            x1 = x0 + 1.0;
        }
        let pad = ((y1 - y0) * 0.05).max(1e-6);
        (y0, y1) = (y0 - pad, y1 + pad);

        // Plot area: room on the left for tick labels and the vertical y label, below for
        // tick labels and the x label, above for the title.
        let (left, right, top, bottom) = (78i64, w as i64 - 16, 28i64, h as i64 - 44);
        if right - left < 40 || bottom - top < 40 {
            return cv.px; // too small to draw anything legible; a blank image, not a panic
        }
        let px = |x: f64| left as f64 + (x - x0) / (x1 - x0) * (right - left) as f64;
        let py = |y: f64| bottom as f64 - (y - y0) / (y1 - y0) * (bottom - top) as f64;

        let (xt, xstep) = ticks(x0, x1, 6);
        for &t in &xt {
            let x = px(t).round() as i64;
            cv.vline(x, top, bottom, GRID);
            cv.vline(x, bottom, bottom + 4, BLACK);
            let l = tick_label(t, xstep);
            cv.text(x - text_width(&l) / 2, bottom + 7, &l, BLACK, false);
        }
        let (yt, ystep) = ticks(y0, y1, 5);
        for &t in &yt {
            let y = py(t).round() as i64;
            cv.hline(left, right, y, GRID);
            cv.hline(left - 4, left, y, BLACK);
            let l = tick_label(t, ystep);
            cv.text(left - 7 - text_width(&l), y - GLYPH / 2, &l, BLACK, false);
        }
        cv.hline(left, right, bottom, BLACK);
        cv.vline(left, top, bottom, BLACK);

        cv.text((left + right) / 2 - text_width(self.x_label) / 2, bottom + 24, self.x_label, BLACK, false);
        cv.text(8, (top + bottom) / 2 + text_width(self.y_label) / 2, self.y_label, BLACK, true);
        cv.text((left + right) / 2 - text_width(self.title) / 2, 10, self.title, BLACK, false);

        for s in &self.series {
            let finite: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
            for win in finite.windows(2) {
                cv.segment((px(win[0].0), py(win[0].1)), (px(win[1].0), py(win[1].1)), s.rgb);
            }
            if finite.len() < 50 {
                // Sparse series (validation) get a marker per point, so one point still shows.
                for &(x, y) in &finite {
                    let (cx, cy) = (px(x).round() as i64, py(y).round() as i64);
                    (cy - 2..=cy + 2).for_each(|yy| cv.hline(cx - 2, cx + 2, yy, s.rgb));
                }
            }
        }

        // Legend: top right, a framed box with a colour swatch and the label of each series.
        let shown: Vec<&Series> = self.series.iter().filter(|s| !s.label.is_empty()).collect();
        if !shown.is_empty() {
            let lw = shown.iter().map(|s| text_width(s.label)).max().unwrap_or(0) + 38;
            let lh = shown.len() as i64 * 14 + 8;
            let (lx, ly) = (right - lw - 8, top + 8);
            for y in ly..=ly + lh {
                cv.hline(lx, lx + lw, y, [255, 255, 255]);
            }
            cv.hline(lx, lx + lw, ly, BLACK);
            cv.hline(lx, lx + lw, ly + lh, BLACK);
            cv.vline(lx, ly, ly + lh, BLACK);
            cv.vline(lx + lw, ly, ly + lh, BLACK);
            for (i, s) in shown.iter().enumerate() {
                let y = ly + 6 + i as i64 * 14;
                for dy in 2..6 {
                    cv.hline(lx + 6, lx + 26, y + dy, s.rgb);
                }
                cv.text(lx + 32, y, s.label, BLACK, false);
            }
        }
        cv.px
    }

    /// Writes the chart as a `w` x `h` PNG at `path`, through a temporary file and a rename.
    pub fn write_png(&self, path: &Path, w: usize, h: usize) -> std::io::Result<()> {
        let rgb = self.render(w, h);
        let tmp = path.with_extension("png.tmp");
        let res = (|| {
            let file = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            let mut enc = png::Encoder::new(file, w as u32, h as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            enc.set_compression(png::Compression::High);
            let mut writer = enc.write_header().map_err(std::io::Error::other)?;
            writer.write_image_data(&rgb).map_err(std::io::Error::other)?;
            writer.finish().map_err(std::io::Error::other)?;
            std::fs::rename(&tmp, path)
        })();
        if res.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        let (t, step) = ticks(0.0, 500.0, 6);
        assert_eq!(step, 100.0);
        assert_eq!(t, vec![0.0, 100.0, 200.0, 300.0, 400.0, 500.0]);
        let (t, step) = ticks(1.93, 8.4, 5);
        assert_eq!(step, 2.0);
        assert_eq!(t, vec![2.0, 4.0, 6.0, 8.0]);
        assert_eq!(tick_label(2.5, 0.5), "2.5");
        assert_eq!(tick_label(300.0, 100.0), "300");
    }

    #[test]
    fn chart_draws_both_series_legend_and_labels() {
        let train: Vec<(f64, f64)> = (1..=100).map(|s| (s as f64, 8.0 / (1.0 + s as f64 / 20.0))).collect();
        let val = vec![(50.0, 3.1), (100.0, 2.6)];
        let chart = Chart {
            title: "loss",
            x_label: "step",
            y_label: "loss",
            series: vec![
                Series { points: &train, rgb: [31, 119, 180], label: "train" },
                Series { points: &val, rgb: [214, 39, 40], label: "validation" },
            ],
        };
        let (w, h) = (640, 400);
        let px = chart.render(w, h);
        let count = |c: [u8; 3]| px.chunks(3).filter(|p| *p == c).count();
        assert!(count([31, 119, 180]) > 300, "train curve missing");
        assert!(count([214, 39, 40]) > 40, "validation markers and legend swatch missing");
        // Text is drawn: dark pixels in the bottom band (x tick labels and the x label) and in
        // the left band (y tick labels and the rotated y label).
        let dark_in = |x0: usize, x1: usize, y0: usize, y1: usize| {
            (y0..y1).flat_map(|y| (x0..x1).map(move |x| (x, y))).filter(|&(x, y)| px[(y * w + x) * 3] == BLACK[0]).count()
        };
        assert!(dark_in(100, 600, h - 40, h) > 40, "x tick labels / x label missing");
        assert!(dark_in(0, 16, 150, 250) > 10, "vertical y label missing");
        let path = std::env::temp_dir().join(format!("ferrolm-plot-{}.png", std::process::id()));
        chart.write_png(&path, w, h).unwrap();
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size < 40_000, "loss.png is {size} bytes: should compress to a few KiB");
        let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
        let info = decoder.read_info().unwrap().info().clone();
        assert_eq!((info.width, info.height), (w as u32, h as u32));
        let _ = std::fs::remove_file(&path);
    }
}
