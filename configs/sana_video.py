"""Sol-RL and its baselines on SANA-Video 2B (text-to-video, 480 x 832, 81 frames, the published 50 DPM-Solver++
steps and guidance 6.0): `sana_video_<family>_<reward>` for the families diffusionnft, naive_scaling, compile,
naive_quant, sol_rl and the rewards imagereward, clipscore, pickscore, hpsv2, hpsv3, ocr, vlm (each scored on 4 frames
spread over the clip; solrl_engine/rl/presets.py says where each value comes from, docs/video.md prices a run).

    solrl train configs/sana_video.py:sana_video_sol_rl_clipscore --output runs/sana-video \\
        --set model_path=/w/sana-video-2b --set reward_args=clipscore.model=/w/clip-l \\
        --set full_steps=20 --set preview_steps=12
"""

from solrl_engine.rl import presets

__all__ = presets.define_presets(globals(), "sana-video", "sana_video")
