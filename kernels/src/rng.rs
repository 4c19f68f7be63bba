//! A small seeded RNG (xoshiro256**, seeded through splitmix64). Injected wherever randomness is
//! used so that every sampling path is reproducible from a seed.

#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut s = [0u64; 4];
        for v in s.iter_mut() {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            *v = x ^ (x >> 31);
        }
        Self { s }
    }

    /// The generator's state, saved with a training checkpoint so that a resumed run draws what
    /// the uninterrupted one would have.
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// A generator continuing from a saved [`Rng::state`] (training resume).
    ///
    /// The all-zero state, which no generator reaches (xoshiro's fixed point: it would draw
    /// only zeros), can only come from a corrupt save; it is replaced by the state of
    /// `Rng::new(0)`.
    pub fn from_state(s: [u64; 4]) -> Self {
        if s == [0; 4] {
            return Self::new(0);
        }
        Self { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Uniform integer in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.uniform() * n as f64) as usize).min(n.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn same_seed_same_stream_and_uniform_mean() {
        let mut a = Rng::new(3);
        let mut b = Rng::new(3);
        assert_eq!(a.next_u64(), b.next_u64());
        let mean: f64 = (0..100_000).map(|_| a.uniform()).sum::<f64>() / 100_000.0;
        assert!((mean - 0.5).abs() < 0.01);
    }

    #[test]
    fn an_all_zero_state_draws_as_seed_zero() {
        let mut a = Rng::from_state([0; 4]);
        let mut b = Rng::new(0);
        let draws: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        assert!(draws.iter().any(|&v| v != 0));
        assert_eq!(draws, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
    }

    #[test]
    fn a_saved_state_continues_the_stream() {
        let mut a = Rng::new(9);
        a.next_u64();
        let mut b = Rng::from_state(a.state());
        for _ in 0..10 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }
}
