//! A dependency-free loss-curve plot: lines drawn into an RGB buffer, written as a PNG with
//! stored (uncompressed) deflate blocks. Small, and readable by every image viewer.
use std::io::Write;
use std::path::Path;

pub struct Series<'a> {
    pub points: &'a [(f64, f64)],
    pub rgb: [u8; 3],
}

/// Draws the series on shared axes (with a light grid) into a `w` x `h` PNG at `path`.
pub fn line_plot(path: &Path, w: usize, h: usize, series: &[Series]) -> std::io::Result<()> {
    let mut img = vec![255u8; w * h * 3];
    let pts = series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    if y1 - y0 < 1e-12 {
        y1 = y0 + 1.0;
    }
    let m = 20.0;
    let px = |x: f64| m + (x - x0) / (x1 - x0) * (w as f64 - 2.0 * m);
    let py = |y: f64| h as f64 - m - (y - y0) / (y1 - y0) * (h as f64 - 2.0 * m);
    let mut put = |x: i64, y: i64, c: [u8; 3]| {
        if x >= 0 && y >= 0 && (x as usize) < w && (y as usize) < h {
            let i = (y as usize * w + x as usize) * 3;
            img[i..i + 3].copy_from_slice(&c);
        }
    };
    for k in 0..=4 {
        let gy = (m + k as f64 * (h as f64 - 2.0 * m) / 4.0) as i64;
        let gx = (m + k as f64 * (w as f64 - 2.0 * m) / 4.0) as i64;
        for i in 0..w as i64 {
            put(i, gy, [225, 225, 225]);
        }
        for j in 0..h as i64 {
            put(gx, j, [225, 225, 225]);
        }
    }
    for s in series {
        for win in s.points.windows(2) {
            let (a, b) = ((px(win[0].0), py(win[0].1)), (px(win[1].0), py(win[1].1)));
            let n = ((b.0 - a.0).abs().max((b.1 - a.1).abs()) as usize).max(1);
            for t in 0..=n {
                let f = t as f64 / n as f64;
                let (x, y) = ((a.0 + f * (b.0 - a.0)) as i64, (a.1 + f * (b.1 - a.1)) as i64);
                put(x, y, s.rgb);
                put(x, y + 1, s.rgb);
            }
        }
    }
    let mut raw = Vec::with_capacity((w * 3 + 1) * h);
    for row in img.chunks(w * 3) {
        raw.push(0); // filter: none
        raw.extend_from_slice(row);
    }
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend((w as u32).to_be_bytes());
    ihdr.extend((h as u32).to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &zlib_stored(&raw));
    chunk(&mut png, b"IEND", &[]);
    let tmp = path.with_extension("png.tmp");
    std::fs::File::create(&tmp)?.write_all(&png)?;
    std::fs::rename(tmp, path)
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend(crc.to_be_bytes());
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = if data.is_empty() { vec![&[][..]] } else { data.chunks(65535).collect() };
    for (i, b) in blocks.iter().enumerate() {
        out.push((i + 1 == blocks.len()) as u8);
        out.extend((b.len() as u16).to_le_bytes());
        out.extend((!(b.len() as u16)).to_le_bytes());
        out.extend_from_slice(b);
    }
    let (mut a, mut s) = (1u32, 0u32);
    for &x in data {
        a = (a + x as u32) % 65521;
        s = (s + a) % 65521;
    }
    out.extend(((s << 16) | a).to_be_bytes());
    out
}
