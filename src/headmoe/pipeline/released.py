"""The released MAGI-2 Preview recipe's constants: the defaults of SandAI's reference
inference and of its public ports (MAGI2.md section 6.7-6.9), the one home of each value.

Values from the release (``golden/magi2_pipeline/README.md``, "Other facts worth knowing";
SandAI ``MAGI-2-preview`` and vLLM-Omni 0.30.0 ``MAGI2_GENERATION_CONFIG``)."""

from __future__ import annotations

#: the release's Hugging Face id (the name clients send as an HTTP request's ``model``)
RELEASED_MODEL_ID = "sand-ai/MAGI-2-preview"

#: denoising steps of the released recipe
RELEASED_NUM_INFERENCE_STEPS = 100
#: flow-matching time shift
RELEASED_SHIFT = 7.0
#: CFG scale of the video velocity
RELEASED_GUIDANCE_SCALE = 5.0
#: CFG scale of the audio velocity
RELEASED_AUDIO_GUIDANCE_SCALE = 7.0
#: the reference's seed when none is given
RELEASED_SEED = 42
#: the transformer's dtype in the release (fp32 islands as in MAGI2.md section 3)
RELEASED_DTYPE = "bf16"
#: text tokens kept per prompt (right padding, truncation beyond)
MAX_TEXT_TOKENS = 7000

#: the released default negative prompt, byte for byte (1,721 characters: a visual, an
#: audio and a speech part; golden/magi2_pipeline/negative_prompt.txt)
RELEASED_NEGATIVE_PROMPT = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works,"
    " paintings, images, static, overall gray, worst quality, low quality,"
    " JPEG compression residue, ugly, incomplete, extra fingers, poorly drawn hands,"
    " poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers,"
    " still picture, messy background, three legs, many people in the background,"
    " walking backwards, low quality, worst quality, poor quality, noise,"
    " background noise, hiss, hum, buzz, crackle, static, compression artifacts,"
    " MP3 artifacts, digital clipping, distortion, muffled, muddy, unclear, echo, reverb,"
    " room echo, over-reverberated, hollow sound, distant, washed out, harsh, shrill,"
    " piercing, grating, tinny, thin sound, boomy, bass-heavy, flat EQ, over-compressed,"
    " abrupt cut, jarring transition, sudden silence, looping artifact, music,"
    " instrumental, sirens, alarms, crowd noise, unrelated sound effects, chaotic,"
    " disorganized, messy, cheap sound, emotionless, flat delivery, deadpan, lifeless,"
    " apathetic, robotic, mechanical, monotone, flat intonation, undynamic, boring,"
    " reading from a script, AI voice, synthetic, text-to-speech, TTS, insincere,"
    " fake emotion, exaggerated, overly dramatic, melodramatic, cheesy, cringey,"
    " hesitant, unconfident, tired, weak voice, stuttering, stammering, mumbling,"
    " slurred speech, mispronounced, bad articulation, lisp, vocal fry, creaky voice,"
    " mouth clicks, lip smacks, wet mouth sounds, heavy breathing, audible inhales,"
    " plosives, p-pops, coughing, clearing throat, sneezing, speaking too fast, rushed,"
    " speaking too slow, dragged out, unnatural pauses, awkward silence, choppy,"
    " disconnected, multiple speakers, two voices, background talking, out of tune,"
    " off-key, autotune artifacts"
)
