"""Token choice and the generation loop (greedy, temperature / top-k / top-p sampling, repetition
penalty, min/max new tokens), orchestrating a GPT2Runner. Seeded sampling draws its uniforms
from a counter-based RNG (Philox4x32-10), so a seeded run gives the same tokens every time."""
