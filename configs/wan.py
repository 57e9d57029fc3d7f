"""Sol-RL and its baselines on Wan (text-to-video), one preset per Wan model, family and reward, with each
model's published inference settings (solrl_engine/rl/presets.py): `wan13b_<family>_<reward>` (Wan2.1-T2V-1.3B,
480 x 832, 81 frames), `wan14b_...` (Wan2.1-T2V-14B), `wan22_5b_...` (Wan2.2-TI2V-5B, 704 x 1280, 121 frames),
`wan22_a14b_...` (Wan2.2-T2V-A14B: two 14B experts, 40 steps, shift 12) and `wan_i2v14b_...` (Wan2.1-I2V-14B-480P,
image-to-video: each clip starts from its prompt's image, i2v/train; every reward but ocr), for the families
diffusionnft, naive_scaling, compile, naive_quant, sol_rl and the rewards imagereward, clipscore, pickscore, hpsv2,
hpsv3, ocr, vlm (each scored on 4 frames spread over the clip; docs/video.md).
    solrl train configs/wan.py:wan13b_sol_rl_clipscore --output runs/wan13b --set model_path=/w/wan2.1-1.3b \\
        --set reward_args=clipscore.model=/w/clip-l --set full_steps=20 --set preview_steps=12
    solrl train configs/wan.py:wan13b_sol_rl_pickscore --set reward=pickscore:1.0,temporal:0.5 ...
"""

from solrl_engine.rl import presets

__all__ = (presets.define_presets(globals(), "wan2.1-1.3b", "wan13b")
           + presets.define_presets(globals(), "wan2.1-14b", "wan14b")
           + presets.define_presets(globals(), "wan2.2-5b", "wan22_5b")
           + presets.define_presets(globals(), "wan2.2-a14b", "wan22_a14b")
           + presets.define_presets(globals(), "wan2.1-i2v-14b", "wan_i2v14b", presets.I2V_REWARDS))  # fmt: skip
