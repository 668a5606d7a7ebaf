"""The epilogue activations' constants, one source for the Triton and the TileLang kernels."""

SQRT_HALF = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
TANH_C = 0.7978845608028654  # sqrt(2 / pi)
TANH_A = 0.044715
LOG2E = 1.4426950408889634
# erfc(u) ~ t (A1 + t (A2 + t (A3 + t (A4 + t A5)))) exp(-u^2), t = 1 / (1 + ERFC_P u), u >= 0: Abramowitz and Stegun
# 7.1.26, absolute error below 1.5e-7
ERFC_P = 0.3275911
ERFC_A1 = 0.254829592
ERFC_A2 = -0.284496736
ERFC_A3 = 1.421413741
ERFC_A4 = -1.453152027
ERFC_A5 = 1.061405429
