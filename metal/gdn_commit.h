// The commit of one Gated DeltaNet layer, shared by the one-layer kernel (gdn_commit.kernel) and
// the kernel that commits every layer of a model in one launch (gdn_commit_layers.kernel).
//
// The recurrent state after the accepted path replays the verify's innovations
// (S = exp(g_j) S + u_j k_j^T for each node j on the path); the conv state is the last K-1
// pre-conv rows of concat(conv_state, x[path]). `groups` threadgroups work on the layer, this one
// is `group`; one SIMD group per state row, RPG rows a group.
#define SPR_COMMIT_STEP 8  // path nodes whose rows are loaded together

template <int K, int Hk, int Dk, int Hv, int Dv, int RPG, typename PX, typename PF, typename PI, typename PC,
          typename PCO, typename PSO>
SPR_FN void spr_commit_layer(PX x, PF k, PF u, PF g, PI path, int L, PC conv_state, PF state, PCO conv_out,
                             PSO state_out, uint group, uint groups, uint local, uint threads, uint warp,
                             uint lane) {
  constexpr int C = 2 * Hk * Dk + Hv * Dv;
  constexpr int E = Dk / SPR_SIMD;
  for (uint i = group * threads + local; i < uint((K - 1) * C); i += groups * threads) {
    const int r = int(i / C), c = int(i % C);
    const int t = L + r;  // row of concat(conv_state [K-1], x[path] [L])
    conv_out[i] = t < K - 1 ? conv_state[t * C + c] : x[path[t - (K - 1)] * C + c];
  }

  const uint row = group * RPG + warp;
  if (row >= uint(Hv * Dv)) {
    return;
  }
  const uint h = row / Dv, v = row % Dv;
  float s[E];
  for (int e = 0; e < E; ++e) {
    s[e] = state[row * Dk + lane + SPR_SIMD * e];
  }
  // The path in steps of SPR_COMMIT_STEP nodes: every load of a step is issued before its first
  // update, so a step waits for memory twice (the path, then its rows) instead of twice a node
  // (node by node the kernel took ~9.6 us a 9B layer for a 9-node path, H200, ncu: latency-bound).
  // The updates still run node after node, so the result is bitwise the plain fold's.
  for (int base = 0; base < L; base += SPR_COMMIT_STEP) {
    int j[SPR_COMMIT_STEP];
    float decay[SPR_COMMIT_STEP], uu[SPR_COMMIT_STEP], kk[SPR_COMMIT_STEP][E];
#pragma unroll
    for (int t = 0; t < SPR_COMMIT_STEP; ++t) {
      j[t] = base + t < L ? path[base + t] : -1;
    }
#pragma unroll
    for (int t = 0; t < SPR_COMMIT_STEP; ++t) {
      if (j[t] >= 0) {
        decay[t] = spr_exp(g[j[t] * Hv + h]);
        uu[t] = u[(j[t] * Hv + h) * Dv + v];
        for (int e = 0; e < E; ++e) {
          kk[t][e] = k[(j[t] * Hv + h) * Dk + lane + SPR_SIMD * e];
        }
      }
    }
#pragma unroll
    for (int t = 0; t < SPR_COMMIT_STEP; ++t) {
      if (j[t] >= 0) {
        for (int e = 0; e < E; ++e) {
          s[e] = decay[t] * s[e] + uu[t] * kk[t][e];
        }
      }
    }
  }
  for (int e = 0; e < E; ++e) {
    state_out[row * Dk + lane + SPR_SIMD * e] = s[e];
  }
}
