//! A container image's settings for the programs run from it (its config's
//! `Env`, `WorkingDir` and `User`), written by the host into the root file
//! system as `/.husk-image` when a template is built from an image, one
//! setting a line: `user UID GID`, `cwd DIR`, `env KEY=VALUE`. Read once at
//! boot; a request's own environment, directory and user win.

use std::sync::OnceLock;

use husk_protocol::User;

const PATH: &str = "/.husk-image";

/// The image's settings (all empty without an image).
#[derive(Debug, Default)]
pub struct Image {
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub user: Option<User>,
}

static IMAGE: OnceLock<Image> = OnceLock::new();

/// No settings: a container's programs (theirs come with each request).
pub static NONE: Image = Image {
    env: Vec::new(),
    cwd: None,
    user: None,
};

/// Reads the settings; lines it does not know are logged and skipped.
pub fn load() {
    let text = std::fs::read_to_string(PATH).unwrap_or_default();
    let _ = IMAGE.set(parse(&text, &mut |line| {
        crate::log(&format!("{PATH}: a line that is not a setting: {line:?}"))
    }));
}

/// The settings (empty before `load`, or without an image).
pub fn get() -> &'static Image {
    IMAGE.get_or_init(Image::default)
}

fn parse(text: &str, unknown: &mut dyn FnMut(&str)) -> Image {
    let mut image = Image::default();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (key, value) = line.split_once(' ').unwrap_or((line, ""));
        match key {
            "env" => match value.split_once('=') {
                Some((k, v)) if !k.is_empty() => image.env.push((k.into(), v.into())),
                _ => unknown(line),
            },
            "cwd" if value.starts_with('/') => image.cwd = Some(value.into()),
            "user" => match value.split_once(' ').map(|(u, g)| (u.parse(), g.parse())) {
                Some((Ok(uid), Ok(gid))) => image.user = Some(User { uid, gid }),
                _ => unknown(line),
            },
            _ => unknown(line),
        }
    }
    image
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_read_and_the_rest_is_reported() {
        let mut bad = Vec::new();
        let image = parse(
            "user 1000 100\ncwd /app\nenv PATH=/app/bin:/bin\nenv GREETING=a=b\nenv =x\ncwd rel\nwho\n",
            &mut |l| bad.push(l.to_owned()),
        );
        assert_eq!(
            image.user,
            Some(User {
                uid: 1000,
                gid: 100
            })
        );
        assert_eq!(image.cwd.as_deref(), Some("/app"));
        assert_eq!(
            image.env,
            [
                ("PATH".into(), "/app/bin:/bin".into()),
                ("GREETING".into(), "a=b".into())
            ]
        );
        assert_eq!(bad, ["env =x", "cwd rel", "who"]);
    }
}
