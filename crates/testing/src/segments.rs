//! Packed rows' segments, from the lengths of the sequences laid in each row.
use ferrolm_ops::Segments;

/// Cumulative boundaries of segments of lengths `lens`: 0, then each running sum.
pub fn cu(lens: &[usize]) -> Vec<u32> {
    std::iter::once(0)
        .chain(lens.iter().scan(0, |s, &l| {
            *s += l;
            Some(*s as u32)
        }))
        .collect()
}

/// Rows of `t` tokens, row i cut into segments of lengths `rows[i]`.
pub fn segments(t: usize, rows: &[Vec<usize>]) -> Segments {
    Segments::new(t, rows.iter().map(|r| cu(r)).collect()).unwrap()
}

/// [`segments`] with `t` the sum of the first row's lengths (rows filled to their end).
pub fn full_rows(rows: &[Vec<usize>]) -> Segments {
    segments(rows[0].iter().sum(), rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_are_running_sums() {
        assert_eq!(cu(&[2, 3, 1]), [0, 2, 5, 6]);
        assert_eq!(cu(&[]), [0]);
    }
}
