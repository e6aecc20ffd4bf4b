"""The MAGI-2 Preview release's components, behind `headmoe.pipeline.interfaces`: the
release folder (`folder`), the text encoder (`text_encoder`, `tiny_text_encoder`), the
video decoders TurboV3 (`turbo_vae`) and Wan2.2 (`wan_vae`, also the image encoder), the
Oobleck audio decoder (`audio_vae`), the video latent space (`video_latents`), safe
component weight reads (`weights`), the tiny stand-ins (`standins`), where each component
runs (`placement`) and the factory that builds a job's components (`components`)."""
