// Gated DeltaNet helpers shared by the kernel bodies; written once for Metal and CUDA with the
// prelude's SPR_* names. Conventions: engine/gdn/__init__.py; math: docs/gdn_tree.md.
//
// Work split used by every GDN kernel: one SIMD group (32 lanes) per row (h, v) of a head's
// recurrent state S [Hv, Dv, Dk]; lane l holds elements l, l + 32, ... of the row (Dk / 32 of
// them), so every load and store of a row is one coalesced 128-byte access per step.

// The committed conv rows [K-1, C] a kernel reads (`at(t, ch)`, t < K-1): the conv state itself,
template <typename PS>
struct spr_conv_rows {
  PS conv_state;
  int C;
  SPR_FN float at(int t, int ch) const { return spr_to_float(conv_state[t * C + ch]); }
};

template <typename PS>
SPR_FN spr_conv_rows<PS> spr_committed(PS conv_state, int C) {
  spr_conv_rows<PS> rows;
  rows.conv_state = conv_state;
  rows.C = C;
  return rows;
}

// or the conv state after a pending accepted path, when the last round's commit is folded into
// the kernel that reads the state: row t is row L + t of concat(conv_state [K-1], x_prev[path]),
// path [L] the accepted nodes' rows of the last verify's pre-conv x_prev.
template <int K, typename PS, typename PI>
struct spr_folded_rows {
  PS conv_state;
  PS x_prev;
  PI path;
  int L;
  int C;
  SPR_FN float at(int t, int ch) const {
    const int r = L + t;
    return spr_to_float(r < K - 1 ? conv_state[r * C + ch] : x_prev[path[r - (K - 1)] * C + ch]);
  }
};

template <int K, typename PS, typename PI>
SPR_FN spr_folded_rows<K, PS, PI> spr_committed_after(PS conv_state, PS x_prev, PI path, int L, int C) {
  spr_folded_rows<K, PS, PI> rows;
  rows.conv_state = conv_state;
  rows.x_prev = x_prev;
  rows.path = path;
  rows.L = L;
  rows.C = C;
  return rows;
}

// Entries of a path padded with -1 to a fixed length (fewer traced shapes): the real length.
template <typename PI>
SPR_FN int spr_path_length(PI path, int padded) {
  int L = 0;
  while (L < padded && path[L] >= 0) {
    ++L;
  }
  return L;
}

// SiLU of the depthwise causal conv of channel `ch` over a K-row window. taps[j] indexes
// concat(committed rows [K-1, C], x [., C]): below K-1 a committed row, from K-1 on a new row.
template <int K, typename R, typename PX, typename PW>
SPR_FN float spr_conv_silu(SPR_THREAD const R& committed, PX x, PW w, SPR_THREAD const int* taps, int C, int ch) {
  float y = 0.0f;
  for (int j = 0; j < K; ++j) {
    const int t = taps[j];
    const float row = t < K - 1 ? committed.at(t, ch) : spr_to_float(x[(t - (K - 1)) * C + ch]);
    y += spr_to_float(w[ch * K + j]) * row;
  }
  return y / (1.0f + spr_exp(-y));
}

struct spr_gate {
  float g;     // log-decay: -exp(A_log) softplus(a + dt_bias)
  float beta;  // sigmoid(b)
};

SPR_FN spr_gate spr_gates(float a, float b, float A_log, float dt_bias) {
  const float x = a + dt_bias;
  const float softplus = spr_max(x, 0.0f) + spr_log(1.0f + spr_exp(-spr_abs(x)));
  spr_gate out;
  out.g = -spr_exp(A_log) * softplus;
  out.beta = 1.0f / (1.0f + spr_exp(-b));
  return out;
}

// q and k of key head hk for one token (conv, SiLU, L2 norm; q also scaled by Dk^-1/2), this
// lane's elements. The one-token step and the tree front both call this, so a tree node's q and k
// round exactly as a step of the same token.
template <int K, int Hk, int Dk, int Hv, int Dv, typename R, typename PX, typename PW>
SPR_FN void spr_token_qk(SPR_THREAD const R& committed, PX x, PW w, SPR_THREAD const int* taps, uint lane, uint hk,
                         SPR_THREAD float* q, SPR_THREAD float* k) {
  constexpr int C = 2 * Hk * Dk + Hv * Dv;
  constexpr int E = Dk / SPR_SIMD;
  float qq = 0.0f, kk = 0.0f;
  for (int e = 0; e < E; ++e) {
    const int ch = int(hk) * Dk + int(lane) + SPR_SIMD * e;
    q[e] = spr_conv_silu<K>(committed, x, w, taps, C, ch);
    k[e] = spr_conv_silu<K>(committed, x, w, taps, C, Hk * Dk + ch);
    qq += q[e] * q[e];
    kk += k[e] * k[e];
  }
  const float q_scale = spr_rsqrt(spr_simd_sum(qq) + 1e-6f) * spr_rsqrt(float(Dk));
  const float k_scale = spr_rsqrt(spr_simd_sum(kk) + 1e-6f);
  for (int e = 0; e < E; ++e) {
    q[e] *= q_scale;
    k[e] *= k_scale;
  }
}
